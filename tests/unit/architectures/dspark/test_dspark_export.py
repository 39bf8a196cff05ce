"""The DSpark export read by an independent reader: written from the published key lists alone (the flat
`Qwen3DSparkModel` config.json fields and the safetensors names), plain tensor math with torch and safetensors, no
import of our model code. It decodes a prompt against the tiny target (its own loop: full target forwards, no
cache) and must give `dflash-train eval`'s tokens, accept lengths and, with a confidence threshold, verified
lengths on the same export."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from _reader_math import ReaderMath

BS, RANK = 4, 32
MAX_NEW = 24


class MinimalDSpark(ReaderMath):
    """A DeepSpec-layout DSpark drafter: DFlash's Qwen3 backbone (context K/V from `fc` + `hidden_norm` of the
    target's features, in front of the block's), `B` slots `[anchor, mask x (B-1)]`, slot k predicting the token
    after position anchor + k, a Markov bias from the token before each slot, and a confidence head."""

    def __init__(self, folder, embed, head):
        self.cfg = json.loads((folder / "config.json").read_text())
        with safe_open(str(folder / "model.safetensors"), "pt") as f:
            self.w = {k: f.get_tensor(k).float() for k in f.keys()}
        c = self.cfg
        assert c["architectures"] == ["Qwen3DSparkModel"] and "dflash_config" not in c
        self.bs, self.mask_id, self.layer_ids = c["block_size"], c["mask_token_id"], c["target_layer_ids"]
        self.rank, self.kind = c["markov_rank"], c["markov_head_type"]
        self.confidence, self.conf_markov = c["enable_confidence_head"], c["confidence_head_with_markov"]
        self.eps, self.heads, self.kv = c["rms_norm_eps"], c["num_attention_heads"], c["num_key_value_heads"]
        self.hd = c.get("head_dim") or c["hidden_size"] // self.heads
        theta = c.get("rope_theta") or c["rope_parameters"]["rope_theta"]
        self.inv_freq = 1.0 / theta ** (torch.arange(0, self.hd, 2).float() / self.hd)
        # embed_tokens / lm_head are optional in the export: the target's when absent
        self.embed = (lambda ids: self.w["embed_tokens.weight"][ids]) if "embed_tokens.weight" in self.w else embed
        self.head_w = self.w.get("lm_head.weight", head.weight.float())

    def hidden(self, features, anchor, start):
        """The block's final normed states `[B, H]`; `features [start, K*H]` of positions 0..start-1."""
        w = self.w
        ctx = self.rms(features @ w["fc.weight"].T, w["hidden_norm.weight"])
        x = self.embed(torch.tensor([anchor] + [self.mask_id] * (self.bs - 1)))
        qpos, kpos = torch.arange(start, start + self.bs), torch.arange(start + self.bs)
        rep = self.heads // self.kv
        for i in range(self.cfg["num_hidden_layers"]):
            p = f"layers.{i}."
            u = self.rms(x, w[p + "input_layernorm.weight"])
            q = (u @ w[p + "self_attn.q_proj.weight"].T).view(self.bs, self.heads, self.hd)
            kv_in = torch.cat([ctx, u])
            k = (kv_in @ w[p + "self_attn.k_proj.weight"].T).view(-1, self.kv, self.hd)
            v = (kv_in @ w[p + "self_attn.v_proj.weight"].T).view(-1, self.kv, self.hd)
            q = self.rope(self.rms(q, w[p + "self_attn.q_norm.weight"]).transpose(0, 1), qpos)
            k = self.rope(self.rms(k, w[p + "self_attn.k_norm.weight"]).transpose(0, 1), kpos)
            att = torch.softmax(q @ k.repeat_interleave(rep, 0).transpose(1, 2) / self.hd ** 0.5, -1)  # non-causal
            o = (att @ v.transpose(0, 1).repeat_interleave(rep, 0)).transpose(0, 1).reshape(self.bs, -1)
            x = x + o @ w[p + "self_attn.o_proj.weight"].T
            u = self.rms(x, w[p + "post_attention_layernorm.weight"])
            m = torch.nn.functional.silu(u @ w[p + "mlp.gate_proj.weight"].T) * (u @ w[p + "mlp.up_proj.weight"].T)
            x = x + m @ w[p + "mlp.down_proj.weight"].T
        return self.rms(x, w["norm.weight"])

    def propose(self, features, anchor, start):
        """(B greedy drafts, each one's confidence sigmoid(logit)), slot by slot from the anchor."""
        w = self.w
        h = self.hidden(features, anchor, start)
        base = h @ self.head_w.T
        prev, state, drafts, conf = anchor, torch.zeros(self.rank), [], []
        for k in range(self.bs):
            z = base[k]
            e = None
            if self.rank:
                e = w["markov_head.markov_w1.weight"][prev]
                if self.kind == "vanilla":
                    f = e
                elif self.kind == "gated":
                    f = torch.sigmoid(w["markov_head.gate_proj.weight"] @ torch.cat([h[k], e])
                                      + w["markov_head.gate_proj.bias"]) * e
                else:  # rnn
                    g, c, o = (w["markov_head.joint_proj.weight"] @ torch.cat([state, e, h[k]])
                               + w["markov_head.joint_proj.bias"]).chunk(3)
                    state = torch.sigmoid(g) * state + (1 - torch.sigmoid(g)) * torch.tanh(c)
                    f = torch.tanh(o)
                z = z + w["markov_head.markov_w2.weight"] @ f
            if self.confidence:
                x = torch.cat([h[k], e]) if self.conf_markov else h[k]
                conf.append(float(torch.sigmoid(w["confidence_head.proj.weight"][0] @ x
                                                + w["confidence_head.proj.bias"][0])))
            prev = int(z.argmax())
            drafts.append(prev)
        return drafts, conf


def reader_decode(reader, target, prompt, max_new, threshold=0.0):
    """Greedy speculative decoding in its plainest form: (tokens, accept lengths, verified lengths)."""
    def forward(ids):
        out = target(input_ids=torch.tensor([ids]), output_hidden_states=True)
        feats = torch.cat([out.hidden_states[i + 1][0] for i in reader.layer_ids], -1)
        return out.logits[0].argmax(-1).tolist(), feats

    argmax, feats = forward(prompt)
    tokens, accepts, verified = [argmax[-1]], [], []
    while len(tokens) < max_new:
        seq = prompt + tokens
        start = len(seq) - 1  # the anchor is the last token; the drafter sees the features before it
        drafts, conf = reader.propose(feats[:start], seq[-1], start)
        if threshold > 0:
            keep = next((k for k, c in enumerate(conf) if c < threshold), len(drafts))
            drafts = drafts[:keep]
        argmax, all_feats = forward(seq + drafts)
        posterior = argmax[start:]
        n = 0
        while n < len(drafts) and drafts[n] == posterior[n]:
            n += 1
        tokens += drafts[:n] + [posterior[n]]
        accepts.append(n + 1)
        verified.append(1 + len(drafts))
        feats = all_feats[:start + n + 1]
    return tokens[:max_new], accepts, verified


@pytest.mark.parametrize("kind", ["vanilla", "rnn"])
def test_an_independent_reader_decodes_the_export_as_eval_does(tiny_target_dir, tmp_path, kind):
    from dflash_train.architectures.family.config import make_drafter_config
    from dflash_train.architectures.dspark.model import DSparkDrafter
    from dflash_train.architectures.io import save_drafter
    from dflash_train.cli import main
    from dflash_train.data.chat import prompt_ids

    target = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    text = "Count from 3."
    prompt = prompt_ids(tokenizer, [{"role": "user", "content": text}])
    with torch.no_grad():  # the target's greedy continuation, to make the drafter often right
        ref = target.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW + BS, do_sample=False)[0, len(prompt):]
    ref = ref.tolist()
    torch.manual_seed(0)
    cfg = make_drafter_config(target.config, num_draft_layers=2, block_size=BS, target_layer_ids=[1, 4],
                              mask_token_id=16)
    cfg.architectures = ["Qwen3DSparkModel"]
    cfg.markov_rank, cfg.markov_head_type = RANK, kind
    cfg.enable_confidence_head, cfg.confidence_head_with_markov = True, True
    d = DSparkDrafter(cfg).eval()
    with torch.no_grad():  # a Markov table of the continuation's bigrams: the drafts often match
        w1, w2 = d.markov_head.markov_w1.weight, d.markov_head.markov_w2.weight
        w1.zero_()
        w2.zero_()
        if kind == "rnn":  # the recurrent feature passes the embedding through: tanh(o), o = 3 * e
            jp = d.markov_head.joint_proj
            jp.weight.zero_()
            jp.bias.zero_()
            jp.weight[2 * RANK:, RANK:2 * RANK] = 3 * torch.eye(RANK)
        pairs = {}
        for a, b in zip(ref, ref[1:]):
            pairs.setdefault(a, b)
        for j, (a, b) in enumerate(list(pairs.items())[:RANK]):
            w1[a, j] = 1.0
            w2[b, j] = 60.0
        conf = d.confidence_head.proj
        conf.weight.zero_()
        conf.bias.fill_(0.5)
        conf.weight[0, -RANK:] = torch.tensor([-4.0 if j % 3 == 2 else 2.0 for j in range(RANK)])  # some slots low
    export = save_drafter(d, tmp_path / "export", dtype="float32")
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": text},
                                             {"role": "assistant", "content": "3 4 5"}]}) + "\n")

    reader = MinimalDSpark(export, target.get_input_embeddings(), target.get_output_embeddings())
    for threshold in (0.0, 0.5):
        out = tmp_path / f"eval-{threshold}.json"
        args = ["eval", "--target", str(tiny_target_dir), "--drafter", str(export), "--data", str(data),
                "--max-new-tokens", str(MAX_NEW), "--out", str(out), "--no-progress", "--device", "cpu"]
        assert main(args + (["--confidence-threshold", str(threshold)] if threshold else [])) == 0
        report = json.loads(out.read_text())
        ours = report["outputs"][0]["modes"]["block"][0]
        with torch.no_grad():
            tokens, accepts, verified = reader_decode(reader, target, prompt, MAX_NEW, threshold)
        assert ours["token_ids"] == tokens == ref[:MAX_NEW]
        assert ours["accept_lengths"] == accepts
        assert ours["verified_lengths"] == verified
        body = report["datasets"][str(data)]["modes"]["block"]
        assert body["verified_per_step"] == sum(verified) / len(verified)
        if threshold == 0:
            assert max(accepts) == BS + 1 and set(verified) == {BS + 1}  # every slot drafts, all verified
            assert body["tau"] > 2.5
        else:
            assert min(verified) < BS + 1 and report["config"]["confidence_threshold"] == 0.5
