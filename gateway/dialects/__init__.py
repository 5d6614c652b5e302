"""The agent APIs other than chat completions, as pure translations (no HTTP, no I/O).

Each dialect turns its request body into a chat-completions body, which enters the one call
pipeline (calls/pipeline.py `prepare_chat_raw`), and turns the pipeline's parsed answer back
into its own response and stream events. So every API renders by the model's chat format, is
recorded token-exactly and bridges across turns exactly like chat completions: there is no
second pipeline.
"""
