import sys

from hiradix.cli import main

sys.exit(main())
