"""How large one request's lists may be, and the smallest values that still mean what they
say. Each list is walked or looked up on the engine core's thread, where every other
request waits on it: a bound per list keeps one request's share of a step bounded, and
a request past one is refused with a 400 naming the field rather than stalling the rest.

The counts are far past what real clients send (OpenAI takes 4 stop strings and 300
logit_bias entries). The lists become sets and tensors once, at admission (engine/rules.py),
so what a request at every bound adds to a step is a few tensor ops on its own row.
"""

from __future__ import annotations

# Lists of strings: how many, and how many characters in all.
MAX_STOP = 256
MAX_STOP_LEN = 512  # one stop string: the detokenizer checks every tail up to this long, per token
MAX_STOP_CHARS = 16_384
MAX_BAD_WORDS = 1_024
MAX_BAD_WORDS_CHARS = 65_536

# Lists of token ids.
MAX_STOP_TOKEN_IDS = 1_024
MAX_LOGIT_BIAS = 1_024
MAX_ALLOWED_TOKEN_IDS = 262_144  # at most a vocabulary's worth: the largest served today

# A temperature below this samples as greedy, as vLLM's _SAMPLING_EPS: dividing logits by
# 1e-45 in float32 is a division by zero, and the row turns into NaNs.
GREEDY_BELOW = 1e-5
MAX_TEMPERATURE = 1e6  # past float32's comfort: -inf / inf is NaN
# repetition_penalty divides or multiplies a logit: near 0 or past this it overflows fp32.
MIN_REPETITION_PENALTY = 1e-2
MAX_REPETITION_PENALTY = 1e2

# A structured-output constraint's text (a JSON schema, a regex, a grammar). xgrammar's
# compile time grows faster than linearly in a schema's optional properties (500 took
# 0.3 s here, 2,000 took 27 s): the size bounds the input, the engine's
# grammar_compile_timeout_s the time.
MAX_GRAMMAR_CHARS = 65_536
