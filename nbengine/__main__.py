"""``python -m nbengine`` is the ``nbengine`` command."""

from nbengine.cli import main

raise SystemExit(main())
