def validate(s): pass
def validate_program(p): pass
