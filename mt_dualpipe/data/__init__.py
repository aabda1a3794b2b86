"""Training data: text corpora tokenised and cut into model batches (``text``); fine-tuning documents
(``documents``), cut into token-budget micro-batches (``batching``) and served as steps (``finetune``)."""
