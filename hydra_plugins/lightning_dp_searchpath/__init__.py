"""Hydra discovers this plugin after ``pip install lightning-dp``: any Hydra app can then compose
``strategy=ring_allreduce`` (and the other config groups of lightning-dp) without copying config files."""

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin


class LightningDPSearchPathPlugin(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        search_path.append(provider="lightning-dp", path="pkg://lightning_dp.conf")
