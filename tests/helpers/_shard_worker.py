"""One rank of the sharded-target tests (tests/unit/target/test_shard.py), started by torch.multiprocessing over gloo: load
the target sharded, check each local shard against transformers' own full load, and capture. Not a test module."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist


def sharded_capture_rank(rank: int, world: int, init_file: str, target: str, group: int, layer_ids: list[int],
                         out_dir: str, compile: bool = False) -> None:
    """`compile`: the sharded capture through `target.compile`'s wiring, Dynamo's eager backend on the CPU."""
    from torch.distributed.tensor import DTensor

    from dflash_train.target.shard import load_sharded_target, rows_of
    from dflash_train.target.capture import TargetCapture

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    warm = {}
    if compile:
        from dflash_train.accel import compile as compile_layer
        from dflash_train.target import capture as target_mod

        target_mod._COMPILE_DEVICES, target_mod._COMPILE_BACKEND = ("cuda", "cpu"), "eager"
        compile_layer.watch_recompiles()
    model, peak, whole, full, index, parts = _sharded_and_whole(load_sharded_target, target, world, group)
    _own_aligned_memory(whole)
    mismatched, sharded = [], 0
    for name, p in model.named_parameters():
        if isinstance(p, DTensor):
            sharded += 1
            start, end = rows_of(p.shape[0], parts, index)
            ok = torch.equal(p.to_local(), full[name][start:end]) and torch.equal(p.full_tensor(), full[name])
        else:
            ok = torch.equal(p, full[name])
        if not ok:
            mismatched.append(name)
    ids = torch.randint(0, whole.config.vocab_size, (2 + rank, 9 + 2 * rank),
                        generator=torch.Generator().manual_seed(rank))
    cap, ref = TargetCapture.from_model(model, layer_ids, compile=compile), TargetCapture.from_model(whole, layer_ids)
    warm = cap.warm_up(length=29)
    got, want = cap(ids), ref(ids)
    got_final, want_final = cap.capture(ids, with_final=True), ref.capture(ids, with_final=True)
    again = cap(ids)  # after a full forward, a cut one again
    with torch.no_grad():  # the HF way (speculative decoding reads it): every layer's output, the final norm's
        hf_got = model(input_ids=ids, output_hidden_states=True).hidden_states
        hf_want = whole(input_ids=ids, output_hidden_states=True).hidden_states
    result = {
        "mismatched": mismatched, "sharded_params": sharded, "peak_host_gib": peak,
        "equal": torch.equal(got, want), "max_diff": float((got - want).abs().max()),
        "equal_with_final": torch.equal(got_final[0], want_final[0]) and torch.equal(got_final[1], want_final[1]),
        "equal_again": torch.equal(again, want),
        "hf_hidden_states_equal": hf_got is not None and len(hf_got) == len(hf_want)
        and all(torch.equal(a, b) for a, b in zip(hf_got, hf_want)), "lm_head_equal": torch.equal(cap.lm_head.weight, ref.lm_head.weight),
        "tied": cap.lm_head.weight is cap.embed_tokens.weight, **warm,
    }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def _own_aligned_memory(model: torch.nn.Module) -> None:
    """Each parameter of `model` copied into memory of its own (the allocator's 64-byte alignment), tied ones
    still tied. transformers loads a float32 CPU checkpoint as views of the memory-mapped safetensors file, at
    the file's 8-byte offsets; the sharded model computes with freshly allocated all-gather buffers. MKL's
    matrix-vector product (a Linear with one output, e.g. Qwen3.5-MoE's `shared_expert_gate`) sums in an order
    that depends on the weight's address, so the whole model would differ from the sharded one by an ulp for
    its layout alone. Same numbers, same addresses' alignment: then the captures must be equal bit for bit."""
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.clone()


def _sharded_and_whole(loader, target: str, world: int, group: int):
    """(this rank's sharded model by `loader`, its peak host GiB, the whole model, its parameters by name, this
    rank's index in its shard group, the group's size)."""
    from dflash_train.target.shard import SHARD_DIM, peak_host_gib, shard_mesh
    from dflash_train.target.capture import load_target_model

    cpu = torch.device("cpu")
    mesh = shard_mesh(cpu, list(range(world)), group)
    model = loader(target, torch.float32, cpu, mesh)
    peak = peak_host_gib()
    whole = load_target_model(target, torch.float32, cpu)
    return (model, peak, whole, dict(whole.named_parameters()), mesh[SHARD_DIM].get_local_rank(),
            mesh[SHARD_DIM].size())


def _relative_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def tp_capture_rank(rank: int, world: int, init_file: str, target: str, group: int, layer_ids: list[int],
                    out_dir: str) -> None:
    """`target.sharding: tp`: each rank's pieces against transformers' own full load (column-parallel rows,
    row-parallel columns, the rest whole), and the capture, a full forward and a KV-cache forward against the
    whole target's (the all-reduce sums in another order: close, not bit-identical)."""
    from torch.distributed.tensor import DTensor

    from dflash_train.target.capture import TargetCapture
    from dflash_train.target.tensor_parallel import load_tp_target
    from dflash_train.infer.spec_decode import new_cache

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    model, peak, whole, full, index, parts = _sharded_and_whole(load_tp_target, target, world, group)
    mismatched, split_dims = [], {}
    for name, p in model.named_parameters():
        if isinstance(p, DTensor) and p.placements[0].is_shard():
            dim = p.placements[0].dim
            split_dims[name.split(".", 3)[-1]] = dim
            ok = torch.equal(p.to_local(), full[name].chunk(parts, dim)[index])
        else:
            ok = torch.equal(p.to_local() if isinstance(p, DTensor) else p, full[name])
        if not ok:
            mismatched.append(name)
    ids = torch.randint(0, whole.config.vocab_size, (2 + rank, 9 + 2 * rank),
                        generator=torch.Generator().manual_seed(rank))
    # Each rank captures its own batch (as in training): the capture runs every group member's in turn.
    cap, ref = TargetCapture.from_model(model, layer_ids), TargetCapture.from_model(whole, layer_ids)
    got, want = cap(ids), ref(ids)
    got_final, want_final = cap.capture(ids, with_final=True), ref.capture(ids, with_final=True)
    shared = torch.randint(0, whole.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():  # the model's own forward: every rank of the group the same input (validation's way)
        hf_got = model(input_ids=shared, output_hidden_states=True).hidden_states
        hf_want = whole(input_ids=shared, output_hidden_states=True).hidden_states
        cached = []
        for m in (model, whole):  # a prompt, then two tokens through the KV cache (speculative decoding's way)
            cache = new_cache()
            m(input_ids=shared[:, :5], past_key_values=cache, use_cache=True)
            cached.append(m(input_ids=shared[:, 5:7], past_key_values=cache, use_cache=True).logits)
    result = {
        "mismatched": mismatched, "split_dims": split_dims, "peak_host_gib": peak,
        "plain_tensor": type(got) is torch.Tensor and type(hf_got[1]) is torch.Tensor,
        "capture_diff": _relative_diff(got, want),
        "final_diff": max(_relative_diff(got_final[0], want_final[0]), _relative_diff(got_final[1], want_final[1])),
        "again_diff": _relative_diff(cap(ids), want),
        "hf_hidden_states_diff": max(_relative_diff(a, b) for a, b in zip(hf_got, hf_want)),
        "hf_layers": [len(hf_got), len(hf_want)], "cached_logits_diff": _relative_diff(*cached),
        "lm_head_equal": torch.equal(cap.lm_head.weight, ref.lm_head.weight),
        "tied": cap.lm_head.weight is cap.embed_tokens.weight,
    }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def _status_gib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 2**20  # kB
    raise KeyError(field)


def sharded_load_memory_rank(rank: int, world: int, init_file: str, target: str, out_dir: str,
                             sharding: str = "fsdp") -> None:
    """How far a sharded load alone raises this process's resident memory at its peak: Linux's peak (VmHWM)
    reset to the current size just before (`clear_refs` 5), so imports and start-up do not hide it."""
    from dflash_train.target.shard import load_sharded_target, resident_bytes, shard_mesh
    from dflash_train.target.capture import TargetCapture
    from dflash_train.target.tensor_parallel import load_tp_target

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    cpu = torch.device("cpu")
    mesh = shard_mesh(cpu, list(range(world)), world)
    Path("/proc/self/clear_refs").write_text("5")
    before = _status_gib("VmRSS")
    model = (load_tp_target if sharding == "tp" else load_sharded_target)(target, torch.float32, cpu, mesh)
    loaded = _status_gib("VmHWM") - before
    Path("/proc/self/clear_refs").write_text("5")
    before = _status_gib("VmRSS")
    TargetCapture.from_model(model, [len(model.model.layers) - 1])  # its first forward gathers every layer
    layer = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())  # whole, not the shard
    result = {"load_peak_gib": loaded, "forward_peak_gib": _status_gib("VmHWM") - before,
              "resident_gib": resident_bytes(model) / 2**30, "layer_gib": layer / 2**30}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def in_turn(rank: int, cases: list[tuple[str, tuple]]) -> None:
    """Several cases' ranks, one after the other, in each spawned process (a new one spends seconds importing
    torch and transformers): `cases` holds (the name of a rank function above, its arguments after `rank`), each
    with its own init file and output folder."""
    for name, args in cases:
        globals()[name](rank, *args)
