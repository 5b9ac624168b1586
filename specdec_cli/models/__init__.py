"""Models and files: GGUF headers, what the user typed turned into a file (names,
Hugging Face references, the config file), pairing a draft with a target, chat formats."""
