import sys

from hiradix_model.walk import main

sys.exit(main())
