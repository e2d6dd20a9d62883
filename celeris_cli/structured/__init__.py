"""Structured output: answers held to a JSON schema, a regular expression, a list of choices or a grammar
(`grammar`: the grammar engine; `commit`: the rule the decoders' commit steps follow for a constrained row, and
the log probabilities of committed tokens). The request's spellings of a constraint, which the settings read
without torch, are `celeris_cli.constraints`."""
