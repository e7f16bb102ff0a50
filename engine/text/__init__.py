"""Text around the tokens: tokenizer and chat templates, incremental detokenization, stop strings."""
