"""``python -m dualblade``: the ``dualblade`` command line where its script is not on ``PATH``
(a package installed with ``pip --target``, or a source tree on ``PYTHONPATH``)."""

import sys

from dualblade.cli import main

sys.exit(main())
