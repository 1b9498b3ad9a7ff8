"""The serving layer: handles and the FCFS scheduler, the tokenizer, LLM and the command line."""
