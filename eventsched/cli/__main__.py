"""``python -m eventsched.cli``: the ``eventsched`` command."""

from eventsched.cli import main

raise SystemExit(main())
