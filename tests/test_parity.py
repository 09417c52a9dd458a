"""The golden reproducer against the public fixture: every golden array within its tolerance."""
import pytest

from async_cosyvoice.tools.golden_compare import compare_dirs, format_table
from async_cosyvoice.tools.reproduce_golden import reproduce


@pytest.fixture(scope="module")
def rows(tiny_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("golden")
    reproduce(tiny_dir, out)
    return compare_dirs(tiny_dir / "golden", out)


def test_every_golden_array_within_tolerance(rows):
    print("\n" + format_table(rows))
    failures = [r for r in rows if not r.ok]
    assert not failures, "\n" + format_table(failures)


def test_the_comparison_covers_every_stage(rows):
    files = {r.file for r in rows}
    for name in ("frontend.npz", "model_inputs.npz", "llm.npz", "ras.npz", "flow.npz", "hift.npz",
                 "e2e_nonstream.npz", "e2e_stream_hop15.npz", "e2e_stream_hop25.npz", "e2e_stream_hop25_p16.npz",
                 "text_frontend.json"):
        assert name in files
    keys = {(r.file, r.key) for r in rows}
    for required in [("flow.npz", "chunk/est_step10_out"), ("hift.npz", "seeded/speech1"),
                     ("e2e_stream_hop15.npz", "audio_zero_noise"), ("llm.npz", "zero_shot/sampler_in")]:
        assert required in keys
    assert not [r for r in rows if r.note == "missing"]


def test_comparison_detects_an_error(tiny_dir, tmp_path, rows):
    """The comparator is not vacuous: a perturbed array fails."""
    import shutil

    import numpy as np
    out = tmp_path / "perturbed"
    shutil.copytree(tiny_dir / "golden", out)
    z = dict(np.load(out / "flow.npz"))
    z["nonstream/mel"] = z["nonstream/mel"] + 1e-3
    np.savez(out / "flow.npz", **z)
    bad = [r for r in compare_dirs(tiny_dir / "golden", out) if not r.ok]
    assert [(r.file, r.key) for r in bad] == [("flow.npz", "nonstream/mel")]
