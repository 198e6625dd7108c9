"""The OpenAI completions and chat API: its protocol models, the handlers that turn a
request into SamplingParams and engine deltas into responses, and their streams."""
