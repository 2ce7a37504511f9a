"""Threads as ranks: point-to-point with MPI matching, collectives built on it."""

import pickle
import threading
import time

import numpy as np

ANY_SOURCE = -1
ANY_TAG = -1
TIMEOUT = 60.0


class Op:
    def __init__(self, name, fn):
        self.name, self.fn = name, fn

    def __call__(self, a, b):
        return self.fn(a, b)


SUM = Op("SUM", lambda a, b: a + b)
PROD = Op("PROD", lambda a, b: a * b)
MAX = Op("MAX", lambda a, b: np.maximum(a, b) if isinstance(a, np.ndarray) else max(a, b))
MIN = Op("MIN", lambda a, b: np.minimum(a, b) if isinstance(a, np.ndarray) else min(a, b))


class Status:
    def __init__(self):
        self.source = ANY_SOURCE
        self.tag = ANY_TAG
        self.count = 0

    def Get_source(self):
        return self.source

    def Get_tag(self):
        return self.tag

    def Get_count(self, datatype=None):
        return self.count


class World:
    """Mailboxes of every rank, shared by the threads."""

    def __init__(self, size):
        self.size = size
        self.cond = threading.Condition()
        self.boxes = [[] for _ in range(size)]


_local = threading.local()
world = None


def _me():
    return _local.rank


def _arr(buf):
    if isinstance(buf, list | tuple):
        buf = buf[0]
    return np.asarray(buf)


class Comm:
    @property
    def rank(self):
        return _me()

    @property
    def size(self):
        return world.size

    def Get_rank(self):
        return _me()

    def Get_size(self):
        return world.size

    # -- point to point ---------------------------------------------------------------------

    def _put(self, ctx, dest, tag, payload):
        if not 0 <= dest < world.size:
            raise ValueError(f"bad destination rank {dest}")
        with world.cond:
            world.boxes[dest].append((ctx, _me(), tag, payload))
            world.cond.notify_all()

    def _take(self, ctx, source, tag, status):
        deadline = time.monotonic() + TIMEOUT
        with world.cond:
            while True:
                box = world.boxes[_me()]
                for i, (c, src, t, payload) in enumerate(box):
                    if c == ctx and source in (ANY_SOURCE, src) and tag in (ANY_TAG, t):
                        del box[i]
                        if status is not None:
                            status.source, status.tag, status.count = src, t, len(payload)
                        return payload
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"rank {_me()}: receive from {source} tag {tag} timed out")
                world.cond.wait(left)

    def send(self, obj, dest, tag=0):
        self._put(0, dest, tag, pickle.dumps(obj))

    def recv(self, buf=None, source=ANY_SOURCE, tag=ANY_TAG, status=None):
        return pickle.loads(self._take(0, source, tag, status))

    def Send(self, buf, dest, tag=0):
        self._put(0, dest, tag, _arr(buf).tobytes())

    def Recv(self, buf, source=ANY_SOURCE, tag=ANY_TAG, status=None):
        data = self._take(0, source, tag, status)
        out = _arr(buf)
        out.reshape(-1).view(np.uint8)[: len(data)] = np.frombuffer(data, dtype=np.uint8)

    def Sendrecv(
        self,
        sendbuf,
        dest,
        sendtag=0,
        recvbuf=None,
        source=ANY_SOURCE,
        recvtag=ANY_TAG,
        status=None,
    ):
        self.Send(sendbuf, dest, sendtag)
        self.Recv(recvbuf, source, recvtag, status)

    def sendrecv(
        self,
        sendobj,
        dest,
        sendtag=0,
        recvbuf=None,
        source=ANY_SOURCE,
        recvtag=ANY_TAG,
        status=None,
    ):
        self.send(sendobj, dest, sendtag)
        return self.recv(None, source, recvtag, status)

    # -- collectives (context 1, folded in rank order at the root) ---------------------------

    def _cput(self, dest, obj):
        self._put(1, dest, 0, pickle.dumps(obj))

    def _cget(self, source):
        return pickle.loads(self._take(1, source, 0, None))

    def bcast(self, obj, root=0):
        if _me() == root:
            for r in range(world.size):
                if r != root:
                    self._cput(r, obj)
            return obj
        return self._cget(root)

    def gather(self, obj, root=0):
        if _me() != root:
            self._cput(root, obj)
            return None
        return [obj if r == root else self._cget(r) for r in range(world.size)]

    def reduce(self, obj, op=SUM, root=0):
        values = self.gather(obj, root)
        if values is None:
            return None
        acc = values[0]
        for v in values[1:]:
            acc = op(acc, v)
        return acc

    def allreduce(self, obj, op=SUM):
        return self.bcast(self.reduce(obj, op, 0), 0)

    def allgather(self, obj):
        return self.bcast(self.gather(obj, 0), 0)

    def Barrier(self):
        self.bcast(self.gather(None, 0), 0)

    barrier = Barrier

    def Bcast(self, buf, root=0):
        arr = _arr(buf)
        arr[...] = self.bcast(arr.copy() if _me() == root else None, root)

    def Reduce(self, sendbuf, recvbuf, op=SUM, root=0):
        acc = self.reduce(_arr(sendbuf).copy(), op, root)
        if _me() == root:
            _arr(recvbuf)[...] = acc

    def Allreduce(self, sendbuf, recvbuf, op=SUM):
        _arr(recvbuf)[...] = self.allreduce(_arr(sendbuf).copy(), op)

    def Gather(self, sendbuf, recvbuf, root=0):
        parts = self.gather(_arr(sendbuf).copy(), root)
        if _me() == root:
            _arr(recvbuf).reshape(-1)[...] = np.concatenate([p.reshape(-1) for p in parts])


COMM_WORLD = Comm()


def Wtime():
    return time.monotonic()


def Finalize():
    pass
