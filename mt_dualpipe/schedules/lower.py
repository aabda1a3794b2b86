def lower(s): raise NotImplementedError
