"""``nbengine bench --peers``: which engines it runs here, and why it skips the others."""

from __future__ import annotations

import importlib.util

import pytest

from nbengine.bench.config import ENGINE_WAIT_POLICY, PEER_ENGINES, BenchConfig, peer_engines
from nbengine.bench.isolation import engine_environment
from nbengine.bench.report import format_report
from nbengine.ops.openmp import PASSIVE_SPINCOUNT

from support.bench import empty_report


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
    policies = {e: own.wait_policy(e) for e in PEER_ENGINES}
    header = format_report(empty_report(omp_wait_policy=None, omp_wait_policies=policies))
    assert "OMP_WAIT_POLICY PASSIVE for nbengine, hf_static, hf_cb, llamacpp; ACTIVE for ct2" in (
        header
    )
    forced_all = {"nbengine": "ACTIVE", "ct2": "ACTIVE"}
    header = format_report(empty_report(omp_wait_policy="ACTIVE", omp_wait_policies=forced_all))
    assert "OMP_WAIT_POLICY ACTIVE," in header
