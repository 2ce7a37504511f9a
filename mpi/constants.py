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
COMM_TYPE_HW_GUIDED: Final = 2
COMM_TYPE_HW_UNGUIDED: Final = 3
COMM_TYPE_RESOURCE_GUIDED: Final = 4

MAX_PROCESSOR_NAME: Final = 128
MAX_ERROR_STRING: Final = 512
MAX_OBJECT_NAME: Final = 128
MAX_INFO_KEY: Final = 255
MAX_INFO_VAL: Final = 1024
MAX_PORT_NAME: Final = 1024
MAX_LIBRARY_VERSION_STRING: Final = 8192
BSEND_OVERHEAD: Final = 96
MAX_DATAREP_STRING: Final = 128
MAX_PSET_NAME_LEN: Final = 256
MAX_STRINGTAG_LEN: Final = 256

# Datatype constructors, as Datatype.Get_envelope names them.
COMBINER_NAMED: Final = 1
COMBINER_DUP: Final = 2
COMBINER_CONTIGUOUS: Final = 3
COMBINER_VECTOR: Final = 4
COMBINER_HVECTOR: Final = 6
COMBINER_INDEXED: Final = 7
COMBINER_HINDEXED: Final = 9
COMBINER_INDEXED_BLOCK: Final = 10
COMBINER_STRUCT: Final = 12
COMBINER_SUBARRAY: Final = 13
COMBINER_DARRAY: Final = 14
COMBINER_F90_REAL: Final = 15
COMBINER_F90_COMPLEX: Final = 16
COMBINER_F90_INTEGER: Final = 17
COMBINER_RESIZED: Final = 18
COMBINER_HINDEXED_BLOCK: Final = 19
COMBINER_VALUE_INDEX: Final = 1

# Datatype.Match_size type classes.
TYPECLASS_REAL: Final = 1
TYPECLASS_INTEGER: Final = 2
TYPECLASS_COMPLEX: Final = 3
TYPECLASS_LOGICAL: Final = 4

# Datatype.Create_darray distributions.
DISTRIBUTE_BLOCK: Final = 121
DISTRIBUTE_CYCLIC: Final = 122
DISTRIBUTE_NONE: Final = 123
DISTRIBUTE_DFLT_DARG: Final = -49767

# Fortran status layout (Status.f2py/py2f).
F_SOURCE: Final = 2
F_TAG: Final = 3
F_ERROR: Final = 4
F_STATUS_SIZE: Final = 5

VERSION: Final = 4
SUBVERSION: Final = 1
