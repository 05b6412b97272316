import sys

from mmserve.dynamo.cli import main

sys.exit(main())
