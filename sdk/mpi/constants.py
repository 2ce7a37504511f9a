"""Integer constants of the MPI namespace, with MPICH's values so programs that print or compare
them behave as they do under mpi4py on MPICH."""

from __future__ import annotations

from typing import Final

ANY_SOURCE: Final = -2
ANY_TAG: Final = -1
PROC_NULL: Final = -1
ROOT: Final = -3
UNDEFINED: Final = -32766
KEYVAL_INVALID: Final = 0x24000000

# Communicator comparison results.
IDENT: Final = 0
CONGRUENT: Final = 1
SIMILAR: Final = 2
UNEQUAL: Final = 3

# Thread support levels.
THREAD_SINGLE: Final = 0
THREAD_FUNNELED: Final = 1
THREAD_SERIALIZED: Final = 2
THREAD_MULTIPLE: Final = 3

# Topology kinds.
GRAPH: Final = 1
CART: Final = 2
DIST_GRAPH: Final = 3

# Predefined attribute keys of COMM_WORLD.
TAG_UB: Final = 0x64400001
HOST: Final = 0x64400003
IO: Final = 0x64400005
WTIME_IS_GLOBAL: Final = 0x64400007
UNIVERSE_SIZE: Final = 0x64400009
LASTUSEDCODE: Final = 0x6440000B
APPNUM: Final = 0x6440000D

TAG_UB_VALUE: Final = 2**31 - 1

# Communicator split types.
COMM_TYPE_SHARED: Final = 1
COMM_TYPE_HW_UNGUIDED: Final = 2
COMM_TYPE_HW_GUIDED: Final = 3
COMM_TYPE_RESOURCE_GUIDED: Final = 4

MAX_PROCESSOR_NAME: Final = 128
MAX_ERROR_STRING: Final = 512
MAX_OBJECT_NAME: Final = 128
MAX_INFO_KEY: Final = 255
MAX_INFO_VAL: Final = 1024
MAX_PORT_NAME: Final = 256
MAX_LIBRARY_VERSION_STRING: Final = 8192
BSEND_OVERHEAD: Final = 96

VERSION: Final = 4
SUBVERSION: Final = 1
