"""Scale-out: engine cores as Ray actors behind the notebook's frontend.

``nb.Engine(model, backend="ray", data_parallel_size=N)`` uses ``RayCoreClient``.
Importing this package does not import Ray; Ray is needed only when a client starts.
"""

from nbengine.distributed.ray_client import RayCoreClient
from nbengine.distributed.router import Router

__all__ = ["RayCoreClient", "Router"]
