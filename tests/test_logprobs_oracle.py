"""Log probabilities against an oracle that shares no code with the decoders: the model's own forward over the
prompt and the answer so far, with no cache, and a log-softmax computed here."""

from __future__ import annotations

import torch

from celeris_cli import load_engine


def test_spec_records_each_tokens_log_softmax_of_a_plain_causal_forward() -> None:
    """`spec` (the default model's left-to-right mode), greedy: each answer token's log probability is the
    log-softmax, at its position, of a causal forward over everything before it, and its top two are that
    distribution's two likeliest (the mutation "log probabilities not normalised" fails here)."""
    e = load_engine(None, device="cpu", dtype="float32")
    params = e.params(
        {"strategy": "spec", "gen_length": 12, "temperature": 0.0, "logprobs": True, "top_logprobs": 2, "min_p": 0}
    )
    model = e.model
    with torch.no_grad():
        h, _ = model.hidden(torch.zeros(1, 1, dtype=torch.long), None, None)
        width = model.step_head()(h[0]).shape[-1]  # the ids the tokenizer can decode
    for text in ("The river", "床前明月光，"):
        ids = e.encode_prompt(text)
        rule = e.rule_for(params)
        assert rule is not None and rule.record is not None
        [answer], _ = e.decode_ids([ids], params, rules=[rule])
        assert sorted(rule.record.at) == list(range(len(rule.record.at))) and len(rule.record.at) >= 4
        for pos, (token, logprob, top) in rule.record.at.items():
            seq = ids + answer[:pos]
            causal = torch.ones(len(seq), len(seq), dtype=torch.bool).tril()[None, None]
            with torch.no_grad():
                logits = model(torch.tensor([seq]), causal)[0, -1, :width].double()
            want = logits - logits.logsumexp(-1)
            assert token == answer[pos] == int(want.argmax())
            assert abs(logprob - float(want[token])) < 1e-4
            assert [t for t, _ in top] == want.topk(2).indices.tolist()
            assert all(abs(v - float(want[t])) < 1e-4 for t, v in top)
