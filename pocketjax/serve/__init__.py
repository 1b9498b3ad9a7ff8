"""The serving layer: handles and the FCFS scheduler, the tokenizer, LLM and the command line; the HTTP server
on top of them is `serve.http`."""
