"""`python -m gwtf` == `gwtf`."""

from gwtf.cli import main

raise SystemExit(main())
