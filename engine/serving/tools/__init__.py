"""Tool calling: tools rendered into the prompt, calls parsed out of the generated text in
each model family's format, and the grammars that force a call."""
