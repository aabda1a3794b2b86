"""Training data: text corpora tokenised and cut into model batches (``text``)."""
