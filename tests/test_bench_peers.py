"""``nbengine bench --peers``: which engines it runs here, and why it skips the others."""

from __future__ import annotations

import importlib.util

import pytest

from nbengine.bench.config import ENGINE_WAIT_POLICY, PEER_ENGINES, BenchConfig, peer_engines
from nbengine.bench.isolation import engine_environment
from nbengine.bench.report import format_report
from nbengine.ops.openmp import PASSIVE_SPINCOUNT


def test_peers_are_the_installed_engines_and_name_the_skipped_ones() -> None:
    engines, skipped = peer_engines()
    assert engines[0] == "nbengine" and set(engines) | set(skipped) == set(PEER_ENGINES)
    assert not set(engines) & set(skipped)
    packages = {"ct2": "ctranslate2", "llamacpp": "llama_cpp"}
    for e, pkg in packages.items():
        installed = importlib.util.find_spec(pkg) is not None
        assert (e in engines) == installed
        if not installed:
            assert pkg in skipped[e] and "bench" in skipped[e]
    BenchConfig(engines=engines)  # every one is a valid engine name


def test_each_engine_runs_under_its_own_wait_policy_unless_one_is_asked_for_all() -> None:
    own = BenchConfig(engines=PEER_ENGINES)
    # CTranslate2 is the one peer that is faster with spinning OpenMP workers.
    assert own.wait_policy("ct2") == "ACTIVE"
    assert {own.wait_policy(e) for e in PEER_ENGINES if e != "ct2"} == {"PASSIVE"}
    assert set(ENGINE_WAIT_POLICY) == set(PEER_ENGINES)
    forced = BenchConfig(engines=PEER_ENGINES, omp_wait_policy="ACTIVE")
    assert {forced.wait_policy(e) for e in PEER_ENGINES} == {"ACTIVE"}
    with pytest.raises(ValueError, match="SPIN"):
        BenchConfig(omp_wait_policy="SPIN")
    # What the workers' environments say: spinning for ct2, a short spin then sleep for
    # the others.
    ct2 = engine_environment(2, own.wait_policy("ct2"))
    nb = engine_environment(2, own.wait_policy("nbengine"))
    assert ct2["OMP_WAIT_POLICY"] == "ACTIVE" and ct2.get("GOMP_SPINCOUNT") != PASSIVE_SPINCOUNT
    assert nb["OMP_WAIT_POLICY"] == "PASSIVE" and nb["GOMP_SPINCOUNT"] == PASSIVE_SPINCOUNT
    # The report's header names them.
    header = format_report(_empty_report({e: own.wait_policy(e) for e in PEER_ENGINES}, None))
    assert "OMP_WAIT_POLICY PASSIVE for nbengine, hf_static, hf_cb, llamacpp; ACTIVE for ct2" in (
        header
    )
    header = format_report(_empty_report({"nbengine": "ACTIVE", "ct2": "ACTIVE"}, "ACTIVE"))
    assert "OMP_WAIT_POLICY ACTIVE," in header


def _empty_report(policies: dict[str, str], forced: str | None) -> dict:
    machine = {
        "cpu_count": 2,
        "cpu_flags": [],
        "torch": "t",
        "torch_threads": 2,
        "transformers": "x",
        "load_average_start": None,
        "load_average_end": None,
        "bandwidth_gb_s": 1.0,
        "matmul_gflop_s": 1.0,
        "matmul_gflop_s_float32": 1.0,
    }
    config = {
        "model_dir": "m",
        "dtype": "bfloat16",
        "scale": 1,
        "repeats": 1,
        "omp_wait_policy": forced,
        "omp_wait_policies": policies,
    }
    return {
        "machine": machine,
        "config": config,
        "results": {},
        "bounds": {},
        "targets": {},
        "warnings": [],
        "elapsed_s": 1.0,
    }
