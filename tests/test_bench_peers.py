"""``nbengine bench --peers``: which engines it runs here, and why it skips the others."""

from __future__ import annotations

import importlib.util

from nbengine.bench.config import PEER_ENGINES, BenchConfig, peer_engines


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
