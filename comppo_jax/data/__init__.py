"""Data: verifiable rewards (`rewards`), data sets and tokenizers (`datasets`, `tokenizers`)."""
