"""Structured output: answers held to a JSON schema, a regular expression, a list of choices or a grammar
(`spec`: the request's spellings, no torch; `grammar`: the grammar engine; `commit`: the rule the decoders'
commit steps follow for a constrained row, and the log probabilities of committed tokens)."""
