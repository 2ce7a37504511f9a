# Author:  Lisandro Dalcin
# Contact: dalcinl@gmail.com
# Copyright (c) 2026, Lisandro Dalcin. BSD-3-Clause: see ../LICENSE.mpi4py.
# Vendored from mpi4py 4.1.2 (src/mpi4py/futures/_core.py) into vpool's mpi4py shim.
# vpool's changes:
# - check_dynamic_pool(), called by MPIPoolExecutor(): a service pool (service=...) raises
#   NotImplementedError at construction (vpool's MPI has no ports or name publishing), instead
#   of its manager thread dying and its futures never completing. Spawned pools are asked of
#   the pool through MPI.Comm.Spawn.
# - _manager_spawn and _manager_service: a failure to spawn or connect breaks the pool
#   (its futures fail with BrokenExecutor naming the error) instead of leaving them pending.
# - SharedPoolCtx._initialize (a shared-pool executor with an initializer) and waitall's
#   polling make their MPI calls through serialized() too: upstream leaves them bare, which
#   only an MPI_THREAD_MULTIPLE library survives, and vpool's grants THREAD_SERIALIZED (its
#   engine is driven by one thread at a time). Several such executors started at once from
#   different threads hung one run in two at 2 ranks (test_futures' test_initializer_4).
# - Lost workers (client_exec rewritten; Workers replaces WorkerSet). A worker is lost when
#   the manager's MPI calls on its intercommunicator raise ERR_PROC_FAILED(_PENDING) or
#   ERR_REVOKED: Get_failed/Ack_failed say which (every worker of a revoked one). It leaves
#   the pool for good, its in-flight task goes back ahead of the queue (the manager's `again`)
#   and is sent to another worker, up to `retries` times (keyword, MPI4PY_FUTURES_RETRIES,
#   default 3: Dask's and Ray's); then its future gets WorkerLost (a BrokenExecutor) naming
#   the worker. A result is used once (a done future ignores a late one). When every worker is
#   lost and none can be had, the executor breaks (BrokenExecutor, "all N workers of the pool
#   were lost ..."). executor.redispatched/workers_lost count; a line on stderr at the end
#   ("mpi4py.futures: N tasks re-dispatched after M workers were lost") says it to programs
#   that do not look. Failures are reported for a spawn with info "vpool_reported" (the
#   default of _manager_spawn) in any job, and for the ranks of a job run with --on-failure
#   ulfm (MPICommExecutor, `python -m mpi4py.futures`). Upstream's future of a dead worker
#   stays pending forever.
# - Stopping: the client sends each live worker STOP_FREE (a standard send: eager) and frees
#   the intercommunicator; the worker frees it too (server_exec returns True). Upstream's
#   synchronous stop and Disconnect barrier would fail at a lost worker, or wait for it
#   forever in a transparent job, where a failure is seen only at logged points.
# - Elastic spawned pools (Grow): the first spawn is soft 1:max_workers; while tasks wait and
#   fewer than max_workers are alive, every grow_interval seconds (keyword,
#   MPI4PY_FUTURES_GROW_INTERVAL, default 5) the manager asks for the missing ones with a
#   soft 0:missing spawn; each one that gives workers is another intercommunicator, synced and
#   initialized as the first, and a worker is (intercommunicator index, rank). num_workers is
#   the count alive now (upstream's is fixed).
# - Determinism of a transparent master (docs/internals.md, "mpi4py.futures on the pool"): a
#   restarted rank replays its MPI calls from its determinants, and the manager thread's calls
#   depend on the main thread's timing (whether the task queue has an item when it looks) and
#   the clock (when to ask for more workers). Each such look is one logged observation
#   (vpool.mpi.observe.value, kind K_VALUE, taken under the serialized lock): live, the value
#   seen, recorded; on replay, the logged value, and the manager waits (observe.until) until
#   its queue holds the item the main thread, replaying, puts there. Everything else it does
#   follows from its own state and logged MPI outcomes (probes, failures); sleeps change
#   nothing. Not covered: cancelling a submitted future (or shutdown(cancel_futures=True))
#   races with the manager, and several executors' manager threads (or a main thread making
#   MPI calls while one runs) interleave their calls by timing: such a master's replay may
#   diverge (the rank then fails as "not deterministic"). The manager thread is marked
#   (observe.thread): checkpoints are refused while it runs, since a forked clone keeps one
#   thread.
"""Management of MPI worker processes."""
# pylint: disable=broad-except
# pylint: disable=too-many-lines
# pylint: disable=protected-access
# pylint: disable=import-outside-toplevel
# pylint: disable=missing-class-docstring
# pylint: disable=missing-function-docstring

import atexit
import collections
import itertools
import os
import sys
import threading
import time
import traceback
import warnings
import weakref

from .. import MPI
from ..util import pkl5
from ._base import BrokenExecutor

# ---

_tls = threading.local()


def serialized(function):
    def wrapper(*args, **kwargs):
        with serialized.lock:
            return function(*args, **kwargs)

    if serialized.lock is None:
        return function
    return wrapper


serialized.lock = None  # type: ignore[attr-defined]


def setup_mpi_threads():
    with setup_mpi_threads.lock:
        thread_level = setup_mpi_threads.thread_level
        if thread_level is None:
            thread_level = MPI.Query_thread()
            setup_mpi_threads.thread_level = thread_level
            if thread_level < MPI.THREAD_MULTIPLE:
                serialized.lock = threading.Lock()
    if thread_level < MPI.THREAD_SERIALIZED:
        warnings.warn(
            "the level of thread support in MPI "
            "should be at least MPI_THREAD_SERIALIZED",
            RuntimeWarning,
            stacklevel=2,
        )


setup_mpi_threads.lock = threading.Lock()  # type: ignore[attr-defined]
setup_mpi_threads.thread_level = None  # type: ignore[attr-defined]


# ---


class RemoteTraceback(Exception):
    pass


def _unwrap_exc(exc, tb):
    exc.__cause__ = RemoteTraceback(tb)
    return exc


class _ExceptionWrapper(Exception):
    def __reduce__(self):
        return _unwrap_exc, self.args


def _wrap_exc(exc, tb):
    exc.__cause__ = None
    exc.__context__ = None
    exc.__traceback__ = None
    return _ExceptionWrapper(exc, tb)


def _format_exc(exc, comm):
    exc_info = (type(exc), exc, exc.__traceback__)
    tb_lines = traceback.format_exception(*exc_info)
    body = "".join(tb_lines)
    host = MPI.Get_processor_name()
    rank = comm.Get_rank()
    size = comm.Get_size()
    info = f"### Worker {rank} of {size} on {host}\n"
    return f'\n{info}"""\n{body}"""'


if sys.version_info >= (3, 11):

    def sys_exception():
        return sys.exception()

else:  # pragma: no cover

    def sys_exception():
        return sys.exc_info()[1]


def os_environ_get(name, default=None):
    varname = f"MPI4PY_FUTURES_{name}"
    if varname not in os.environ:
        oldname = f"MPI4PY_{name}"
        if oldname in os.environ:  # pragma: no cover
            warnings.warn(
                f"environment variable {oldname} is deprecated, use {varname}",
                DeprecationWarning,
                stacklevel=1,
            )
            return os.environ[oldname]
    return os.environ.get(varname, default)


# ---


BACKOFF = 0.001


def _getopt_backoff(options):
    backoff = options.get("backoff")
    if backoff is None:
        backoff = os_environ_get("BACKOFF", BACKOFF)
    return float(backoff)


class Backoff:
    #
    def __init__(self, seconds=BACKOFF):
        self.tval = 0.0
        self.tmax = max(float(seconds), 0.0)
        self.tmin = self.tmax / (1 << 10)

    def reset(self):
        self.tval = 0.0

    def sleep(self):
        time.sleep(self.tval)
        self.tval = min(self.tmax, max(self.tmin, self.tval * 2))


class TaskQueue(collections.deque):
    put = collections.deque.append
    pop = collections.deque.popleft
    add = collections.deque.appendleft


class WorkerSet(collections.deque):
    add = collections.deque.append
    pop = collections.deque.popleft


THREADS_QUEUES = weakref.WeakKeyDictionary()  # type: weakref.WeakKeyDictionary


def join_threads(threads_queues=THREADS_QUEUES):
    items = list(threads_queues.items())
    for _, queue in items:  # pragma: no cover
        queue.put(None)
    for thread, _ in items:  # pragma: no cover
        thread.join()


if hasattr(threading, "_register_atexit"):
    threading._register_atexit(join_threads)
else:  # pragma: no cover
    atexit.register(join_threads)


class Pool:
    #
    def __init__(self, executor, manager, *args):
        self.size = None
        self.event = threading.Event()
        self.queue = queue = TaskQueue()
        self.exref = weakref.ref(executor, lambda _, q=queue: q.put(None))

        args = (self, executor._options, *args)
        thread = threading.Thread(target=_marked, args=(manager, *args))  # vpool
        self.thread = thread

        setup_mpi_threads()
        thread.daemon = not hasattr(threading, "_register_atexit")
        thread.start()
        THREADS_QUEUES[thread] = queue

    def wait(self):
        self.event.wait()

    def push(self, item):
        self.queue.put(item)

    def done(self):
        self.queue.put(None)

    def join(self):
        self.thread.join()

    def setup(self, size):
        self.size = size
        self.event.set()
        return self.queue

    def cancel(self, handler=None):
        queue = self.queue
        while True:
            try:
                item = queue.pop()
            except LookupError:
                break
            if item is None:
                queue.put(None)
                break
            future, task = item
            if handler:
                handler(future)
            else:
                future.cancel()
                future.set_running_or_notify_cancel()
            del future, task, item

    def broken(self, message):
        lock = None
        executor = self.exref()
        if executor is not None:
            executor._broken = message
            if not executor._shutdown:
                lock = executor._lock

        def handler(future):
            if future.set_running_or_notify_cancel():
                exception = BrokenExecutor(message)
                future.set_exception(exception)

        self.event.set()
        if lock:
            lock.acquire()
        try:
            self.cancel(handler)
        finally:
            if lock:
                lock.release()


def _marked(manager, *args):
    """vpool: the manager thread runs marked as one a checkpoint cannot keep."""
    from vpool.mpi import observe

    with observe.thread("mpi4py.futures manager"):
        manager(*args)


def initialize(options):
    initializer = options.pop("initializer", None)
    initargs = options.pop("initargs", ())
    initkwargs = options.pop("initkwargs", {})
    if initializer is not None:
        try:
            initializer(*initargs, **initkwargs)
        except BaseException:
            return False
        else:
            return True
    return True


def _manager_thread(pool, options):
    size = options.pop("max_workers", 1)
    queue = pool.setup(size)
    threads = collections.deque()
    max_threads = size - 1

    def init():
        if not initialize(options):
            pool.broken("initializer failed")
            return False
        return True

    def adjust():
        if len(threads) < max_threads:
            thread = threading.Thread(target=worker)
            thread.start()
            threads.append(thread)

    def execute(future, task):
        func, args, kwargs = task
        result = exception = None
        try:
            result = func(*args, **kwargs)
            future.set_result(result)
        except BaseException:
            exception = sys_exception()
            future.set_exception(exception)
        del result, exception
        del func, args, kwargs
        del future, task

    def finalize():
        for thread in threads:
            thread.join()
        queue.pop()

    def worker():
        backoff = Backoff(_getopt_backoff(options))
        if not init():
            queue.put(None)
            return
        while True:
            try:
                item = queue.pop()
                backoff.reset()
            except LookupError:
                backoff.sleep()
                continue
            if item is None:
                queue.put(None)
                break
            future, task = item
            if future.set_running_or_notify_cancel():
                if queue:
                    adjust()
                execute(future, task)
            del future, task, item

    worker()
    finalize()


def _manager_comm(pool, options, comm, sync=True, grow=None):
    assert comm != MPI.COMM_NULL  # noqa: S101
    assert comm.Is_inter()  # noqa: S101
    assert comm.Get_size() == 1  # noqa: S101
    comm = client_sync(comm, options, sync)
    if not client_init(comm, options):
        pool.broken("initializer failed")
        client_stop(comm)
        return
    size = comm.Get_remote_size()
    workers = Workers(size)  # vpool
    workers.comms[0] = comm
    pool.workers = workers
    queue = pool.setup(size)
    try:
        client_exec(comm, options, 0, workers, queue, pool, grow)
    finally:
        for link in workers.comms.values():
            client_stop(link, workers)


def _manager_spawn(pool, options):
    pyexe = options.pop("python_exe", None)
    pyargs = options.pop("python_args", None)
    nprocs = options.pop("max_workers", None)
    info = options.pop("mpi_info", None)
    if nprocs is None:  # vpool: the most workers an elastic pool may have
        nprocs = get_max_workers()
    grow = None
    if info is None:  # vpool: MPIPoolExecutor's default on vpool: elastic, reported workers
        info = {"soft": f"1:{nprocs}", "vpool_reported": "true"}
        grow = Grow(options, nprocs, (pyexe, pyargs, {"vpool_reported": "true"}))
    try:
        comm = serialized(client_spawn)(pyexe, pyargs, nprocs, info)
    except Exception as exc:  # vpool
        pool.broken(f"cannot spawn workers: {exc!r}")
        return
    _manager_comm(pool, options, comm, grow=grow)


def _manager_service(pool, options):
    service = options.pop("service", None)
    info = options.pop("mpi_info", None)
    try:
        comm = serialized(client_connect)(service, info)
    except Exception as exc:  # vpool
        pool.broken(f"cannot connect to the service: {exc!r}")
        return
    _manager_comm(pool, options, comm)


def ThreadPool(executor):
    # pylint: disable=invalid-name
    return Pool(executor, _manager_thread)


def SpawnPool(executor):
    # pylint: disable=invalid-name
    return Pool(executor, _manager_spawn)


def ServicePool(executor):
    # pylint: disable=invalid-name
    return Pool(executor, _manager_service)


def WorkerPool(executor):
    # pylint: disable=invalid-name
    if SharedPool is not None:
        return SharedPool(executor)
    if "service" in executor._options:
        return ServicePool(executor)
    return SpawnPool(executor)


def check_dynamic_pool(executor):
    """vpool: raise NotImplementedError if the executor's workers would be connected to as an
    MPI service, which vpool's MPI cannot do (no ports or name publishing), rather than fail
    later in the pool's thread. Spawned workers are asked of the pool (``Comm.Spawn``)."""
    if executor._make_pool is not WorkerPool:
        return
    if SharedPool is not None or getattr(_tls, "pool_given", False):
        return
    if "service" in executor._options:
        raise NotImplementedError(
            "MPIPoolExecutor(service=...) connects to an MPI service, "
            "and vpool's MPI has no ports or name publishing"
        )


# ---

SharedPool = None  # pylint: disable=invalid-name


def _set_shared_pool(obj):
    # pylint: disable=global-statement
    global SharedPool
    SharedPool = obj


class SharedPoolCtx:
    #
    def __init__(self):
        self.lock = threading.Lock()
        self.comm = MPI.COMM_NULL
        self.intracomm = MPI.COMM_NULL
        self.on_root = None
        self.counter = None
        self.workers = None
        self.threads = weakref.WeakKeyDictionary()

    def __reduce__(self):
        return "SharedPool"

    def _initialize_remote(self):
        barrier(self.intracomm)
        server_init(self.comm)

    def _initialize(self, options, tag):
        if tag == 0:
            self.comm = client_sync(self.comm, options)
            return client_init(self.comm, options)
        if options.get("initializer") is None:
            return True
        task = (self._initialize_remote, (), {})
        reqs = serialized(isendtoall)(self.comm, task, tag)  # vpool: serialized
        waitall(self.comm, reqs, poll=True)
        success = client_init(self.comm, options)
        serialized(recvfromall)(self.comm, tag)  # vpool: serialized
        return success

    def _manager(self, pool, options):
        if self.counter is None:
            options["max_workers"] = 1
            set_comm_server(MPI.COMM_SELF)
            _manager_thread(pool, options)
            return
        with self.lock:
            tag = next(self.counter)
            if not self._initialize(options, tag):
                pool.broken("initializer failed")
                return
        comm = self.comm
        size = comm.Get_remote_size()
        pool.workers = self.workers  # vpool
        queue = pool.setup(size)
        client_exec(comm, options, tag, self.workers, queue, pool)  # vpool: pool

    def __call__(self, executor):
        assert SharedPool is self  # noqa: S101
        with self.lock:
            pool = Pool(executor, self._manager)
            del THREADS_QUEUES[pool.thread]
            self.threads[pool.thread] = pool.queue
        return pool

    def __enter__(self):
        assert SharedPool is None  # noqa: S101
        comm, root = MPI.COMM_WORLD, 0
        self.on_root = comm.Get_rank() == root
        self.comm, self.intracomm = comm_split(comm, root)
        if self.comm != MPI.COMM_NULL and self.on_root:
            size = self.comm.Get_remote_size()
            self.counter = itertools.count(0)
            self.workers = Workers(size)  # vpool
        _set_shared_pool(self)
        return self if self.on_root else None

    def __exit__(self, *args):
        assert SharedPool is self  # noqa: S101
        if self.on_root:
            join_threads(self.threads)
        if self.comm != MPI.COMM_NULL:
            comm = self.comm
            if self.on_root:
                if next(self.counter) == 0:
                    options = {"main": False}
                    self._initialize(options, 0)
                client_stop(comm, self.workers)  # vpool: workers
            else:
                intracomm = self.intracomm
                set_comm_server(intracomm)
                server_main_comm(comm)
                del_comm_server()
                intracomm.Free()
        if not self.on_root:
            join_threads(self.threads)
        _set_shared_pool(None)
        self.comm = MPI.COMM_NULL
        self.intracomm = MPI.COMM_NULL
        self.on_root = None
        self.counter = None
        self.workers = None
        self.threads.clear()
        return False


# ---


def comm_split(comm, root):
    if comm.Get_size() == 1:
        comm = MPI.Intercomm(MPI.COMM_NULL)
        intracomm = MPI.Intracomm(MPI.COMM_NULL)
        return comm, intracomm
    rank = comm.Get_rank()
    if MPI.Get_version() >= (2, 2):
        allgroup = comm.Get_group()
        if rank == root:
            group = allgroup.Incl([root])
        else:
            group = allgroup.Excl([root])
        allgroup.Free()
        intracomm = comm.Create(group)
        group.Free()
    else:  # pragma: no cover
        color = 0 if rank == root else 1
        intracomm = comm.Split(color, key=0)

    if rank == root:
        local_leader = 0
        remote_leader = 0 if root else 1
    else:
        local_leader = 0
        remote_leader = root
    intercomm = intracomm.Create_intercomm(
        local_leader, comm, remote_leader, tag=0
    )
    if rank == root:
        intracomm.Free()
    return intercomm, intracomm


# ---


def _comm_executor_helper(executor, comm, root):
    def _manager(pool, options, comm, root):
        if comm.Get_size() == 1:
            options["max_workers"] = 1
            set_comm_server(MPI.COMM_SELF)
            _manager_thread(pool, options)
            return
        comm, _ = serialized(comm_split)(comm, root)
        _manager_comm(pool, options, comm, sync=False)

    if comm.Get_rank() == root:
        if SharedPool is not None:
            pool = SharedPool(executor)
        else:
            pool = Pool(executor, _manager, comm, root)
        executor._pool = pool
    else:
        comm, intracomm = comm_split(comm, root)
        set_comm_server(intracomm)
        server_main_comm(comm, sync=False)
        del_comm_server()
        intracomm.Free()


# ---


def _getenv_use_pkl5():
    value = os_environ_get("USE_PKL5")
    if value is None:
        return None
    if value.lower() in ("false", "no", "off", "n", "0"):
        return False
    if value.lower() in ("true", "yes", "on", "y", "1"):
        return True
    warnings.warn(
        f"environment variable MPI4PY_FUTURES_USE_PKL5: "
        f"unexpected value {value!r}",
        RuntimeWarning,
        stacklevel=1,
    )
    return False


def _setopt_use_pkl5(options):
    use_pkl5 = options.get("use_pkl5")
    if use_pkl5 is None:
        use_pkl5 = _getenv_use_pkl5()
    if use_pkl5 is not None:
        options["use_pkl5"] = use_pkl5


def _get_comm(comm, options):
    use_pkl5 = options.pop("use_pkl5", None)
    if use_pkl5:
        return pkl5.Intercomm(comm)
    return comm


def _get_request(comm):
    use_pkl5 = isinstance(comm, pkl5.Comm)
    if use_pkl5:
        return pkl5.Request
    return MPI.Request


# ---


def barrier(comm):
    try:
        request = comm.Ibarrier()
        backoff = Backoff()
        while not request.Test():
            backoff.sleep()
    except (NotImplementedError, MPI.Exception):  # pragma: no cover
        buf = [None, 0, MPI.BYTE]
        tag = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)
        sendreqs, recvreqs = [], []
        if comm.Is_inter():
            size = comm.Get_remote_size()
        else:
            size = comm.Get_size()
        for pid in range(size):
            recvreqs.append(comm.Irecv(buf, pid, tag))
            sendreqs.append(comm.Issend(buf, pid, tag))
        backoff = Backoff()
        while not MPI.Request.Testall(recvreqs):
            backoff.sleep()
        MPI.Request.Waitall(sendreqs)


def bcast_send(comm, data):
    if MPI.VERSION >= 2:
        comm.bcast(data, MPI.ROOT)
    else:  # pragma: no cover
        tag = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)
        sendtoall(comm, data, tag)


def bcast_recv(comm):
    if MPI.VERSION >= 2:
        data = comm.bcast(None, 0)
    else:  # pragma: no cover
        tag = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)
        data = comm.recv(None, 0, tag)
    return data


def isendtoall(comm, data, tag=0):
    size = comm.Get_remote_size()
    return [comm.issend(data, pid, tag) for pid in range(size)]


def waitall(comm, requests, poll=False):
    if poll:
        request_testall = serialized(_get_request(comm).testall)  # vpool
        backoff = Backoff()
        while True:
            done, objs = request_testall(requests)
            if done:
                return objs
            backoff.sleep()
    else:
        request_waitall = _get_request(comm).waitall
        return request_waitall(requests)


def sendtoall(comm, data, tag=0):
    requests = isendtoall(comm, data, tag)
    waitall(comm, requests)


def recvfromall(comm, tag=0):
    size = comm.Get_remote_size()
    return [comm.recv(None, pid, tag) for pid in range(size)]


def disconnect(comm):
    try:
        comm.Disconnect()
    except NotImplementedError:  # pragma: no cover
        comm.Free()


# ---


def client_sync(comm, options, sync=True):
    serialized(barrier)(comm)
    _setopt_use_pkl5(options)
    if sync:
        options = _sync_get_data(options)
    serialized(bcast_send)(comm, options)
    comm = _get_comm(comm, options)
    return comm


def client_init(comm, options):
    serialized(bcast_send)(comm, _init_get_data(options))
    sbuf = bytearray([False])
    rbuf = bytearray([False])
    serialized(comm.Allreduce)(sbuf, rbuf, op=MPI.LAND)
    success = bool(rbuf[0])
    return success


# vpool: lost workers, re-dispatch, elastic workers.

RETRIES = 3
GROW_INTERVAL = 5.0
STOP_FREE = "vpool: stop, then free the intercommunicator"

FAILURES = (
    MPI.ERR_PROC_FAILED,
    MPI.ERR_PROC_FAILED_PENDING,
    MPI.ERR_REVOKED,
)


class WorkerLost(BrokenExecutor):
    """vpool: the worker running a task was lost more times than the executor retries it
    (``retries``, ``MPI4PY_FUTURES_RETRIES``, default 3). A `BrokenExecutor`, as the
    ``BrokenProcessPool`` that `concurrent.futures` gives the futures of a dead worker; the
    executor goes on with its other workers."""

    def __init__(self, message, worker=None, tries=0):
        super().__init__(message)
        self.worker = worker
        self.tries = tries


def _getopt_retries(options):
    retries = options.get("retries")
    if retries is None:
        retries = os_environ_get("RETRIES", RETRIES)
    return max(int(retries), 0)


def _getopt_grow_interval(options):
    interval = options.get("grow_interval")
    if interval is None:
        interval = os_environ_get("GROW_INTERVAL", GROW_INTERVAL)
    return max(float(interval), 0.0)


def _is_failure(exc):
    return isinstance(exc, MPI.Exception) and exc.Get_error_class() in FAILURES


class Workers(WorkerSet):
    """vpool: the idle workers (the deque, as upstream's WorkerSet) and the bookkeeping of
    the pool's links: ``comms[k]`` is the k-th intercommunicator to workers (the first one,
    then one per spawn that grew the pool), a worker is ``(k, rank)`` in its remote group.
    Shared by the manager threads of a shared pool; ``epoch`` counts losses, so each thread
    sees the losses another one found (a failure is acknowledged once per communicator)."""

    def __init__(self, size=0):
        super().__init__((0, pid) for pid in range(size))
        self.comms = {}
        self.alive = {(0, pid) for pid in range(size)}
        self.dead = {}  # worker -> its name
        self.epoch = 0
        self.mutex = threading.Lock()

    def link(self, comm):
        """Add the workers of another intercommunicator; its index."""
        with self.mutex:
            k = len(self.comms)
            self.comms[k] = comm
            for pid in range(comm.Get_remote_size()):
                self.alive.add((k, pid))
                self.add((k, pid))
        return k

    def name(self, worker):
        k, pid = worker
        text = f"worker {pid}" if k == 0 else f"worker {pid} of spawn {k}"
        comm = self.comms.get(k)
        members = getattr(comm.Get_remote_group(), "_members", None) if comm else None
        if members is not None and pid < len(members):
            text += f" (job rank {members[pid]})"
        return text

    def lose(self, found):
        """Workers found failed: out of the pool for good."""
        with self.mutex:
            new = [w for w in found if w in self.alive]
            for worker in new:
                self.alive.discard(worker)
                self.dead[worker] = self.name(worker)
                try:
                    self.remove(worker)
                except ValueError:
                    pass  # busy: its manager thread re-dispatches its task
            if new:
                self.epoch += 1
        return new

    def failed(self, k, exc):
        """The workers of link ``k`` known failed, after ``exc`` (acknowledged, so that
        receives from any source work again)."""
        comm = self.comms[k]
        if exc.Get_error_class() == MPI.ERR_REVOKED:
            return [(k, pid) for pid in range(comm.Get_remote_size())]
        group = serialized(comm.Get_failed)()
        try:
            size = group.Get_size()
            ranks = []
            if size:
                remote = comm.Get_remote_group()
                ranks = MPI.Group.Translate_ranks(group, list(range(size)), remote)
                remote.Free()
        finally:
            group.Free()
        serialized(comm.Ack_failed)()
        return [(k, pid) for pid in ranks if pid != MPI.UNDEFINED]


class Grow:
    """vpool: more workers for a spawned pool, asked of the pool while tasks wait and fewer
    than ``size`` workers are alive, every ``interval`` seconds (soft spawns of 0 up to what
    is missing; the pool grants what its free slots take)."""

    def __init__(self, options, size, spawn_args):
        self.size = size
        self.interval = _getopt_grow_interval(options)
        self.options = dict(options)
        self.spawn_args = spawn_args
        self.last = time.monotonic()
        self.stopped = False

    def wanted(self, workers):
        return not self.stopped and len(workers.alive) < self.size

    def due(self):
        return time.monotonic() - self.last >= self.interval

    def spawn(self, workers):
        """One attempt: the workers it gave joined ``workers`` (False: none)."""
        self.last = time.monotonic()
        missing = self.size - len(workers.alive)
        pyexe, pyargs, info = self.spawn_args
        info = dict(info or {})
        info["soft"] = f"0:{missing}"
        try:
            comm = serialized(client_spawn)(pyexe, pyargs, missing, info)
        except MPI.Exception:
            return False  # no free slot now: the soft spawn got nobody
        finally:
            self.last = time.monotonic()
        options = dict(self.options)
        comm = client_sync(comm, options)
        if not client_init(comm, options):
            self.stopped = True  # their initializer fails: so would the next ones'
            client_stop(comm)
            return False
        workers.link(comm)
        return True


def _report(executor_ref, redispatched, lost):
    executor = executor_ref() if executor_ref is not None else None
    if executor is not None:
        executor.redispatched = redispatched
        executor.workers_lost = lost


def client_exec(comm, options, tag, worker_set, task_queue, pool=None, grow=None):
    # pylint: disable=too-many-locals
    # pylint: disable=too-many-statements
    # vpool: rewritten around lost workers (_core.py's header, docs/internals.md).
    from vpool.mpi import observe

    backoff = Backoff(_getopt_backoff(options))
    retries = _getopt_retries(options)
    workers = worker_set
    workers.comms.setdefault(0, comm)
    exref = pool.exref if pool is not None else None

    status = MPI.Status()
    pending = {}  # worker -> (future, task, request)
    again = collections.deque()  # tasks of lost workers, sent before the queue's
    tries = {}  # future -> times its worker was lost
    lost_here = []  # workers lost with a task of ours, or found failed by us
    counts = [0]  # re-dispatches
    seen = [workers.epoch]
    stopping = False

    def comm_of(worker):
        return workers.comms[worker[0]]

    def found(k, exc):
        new = workers.lose(workers.failed(k, exc))
        lost_here.extend(w for w in new if w not in lost_here)
        return new

    def reclaim():
        """Tasks of workers lost (found by this thread or another): sent again, or failed
        once their workers were lost more than ``retries`` times."""
        seen[0] = workers.epoch
        for worker in [w for w in pending if w in workers.dead]:
            future, task, request = pending.pop(worker)
            if worker not in lost_here:
                lost_here.append(worker)
            try:
                serialized(request.Free)()
            except MPI.Exception:
                pass
            n = tries.get(future, 0) + 1
            if n > retries:
                tries.pop(future, None)
                name = workers.dead[worker]
                future.set_exception(
                    WorkerLost(
                        f"{name} was lost running this task, and so were its workers "
                        f"the {retries} times it was sent again (retries={retries})",
                        name,
                        n,
                    )
                )
            else:
                tries[future] = n
                again.append((future, task))
                counts[0] += 1
            del future, task, request
        _report(exref, counts[0], len(lost_here))

    def recv(worker):
        k, pid = worker
        try:
            task = serialized(comm_of(worker).recv)(None, pid, tag, status)
        except MPI.Exception as exc:
            if not _is_failure(exc):
                task = (None, exc)
            else:
                found(k, exc)
                return
        except BaseException:
            task = (None, sys_exception())
        entry = pending.pop(worker)
        if worker in workers.alive:
            workers.add(worker)
        future, request = entry[0], entry[2]
        tries.pop(future, None)
        try:
            serialized(request.Free)()
        except MPI.Exception:
            pass
        result, exception = task
        if not future.done():  # a late duplicate finds it done: used once
            if exception is None:
                future.set_result(result)
            else:
                future.set_exception(exception)
        del result, exception, future, task, entry

    def poll():
        """Receive a result, if one came (True)."""
        for k in sorted({w[0] for w in pending}):
            try:
                got = serialized(workers.comms[k].iprobe)(MPI.ANY_SOURCE, tag, status)
            except MPI.Exception as exc:
                if not _is_failure(exc):
                    raise
                if not found(k, exc) and workers.epoch == seen[0]:
                    backoff.sleep()  # nothing new to learn: do not spin on the error
                return True
            if got:
                recv((k, status.source))
                return True
        return False

    def send(item):
        try:
            worker = workers.pop()
        except LookupError:  # another executor's thread took it
            if item is not None:
                again.appendleft(item)
            return
        future, task = item
        try:
            request = serialized(comm_of(worker).issend)(task, worker[1], tag)
        except MPI.Exception as exc:
            if not _is_failure(exc):
                if worker in workers.alive:
                    workers.add(worker)
                future.set_exception(exc)
                return
            again.appendleft(item)
            found(worker[0], exc)
            workers.lose([worker])
            return
        except BaseException:
            if worker in workers.alive:
                workers.add(worker)
            future.set_exception(sys_exception())
            return
        pending[worker] = (future, task, request)
        del future, task, item

    def look():
        """What the main thread and the clock decided by now, as the manager's MPI calls
        depend on it: a logged observation (vpool.mpi.observe) in a transparent job. Bit 1:
        the task queue has an item (looked at only when a worker is idle and no task waits
        to be sent again); bit 2: time to ask for more workers."""
        idle = bool(workers) and not again and not stopping
        growing = grow is not None and grow.wanted(workers) and (not stopping or again)
        if not idle and not growing:
            return 0

        def live():
            queued = bool(task_queue)
            value = 1 if idle and queued else 0
            if growing and (queued or again) and grow.due():
                value |= 2
            return value or None

        value = serialized(observe.value)(live) or 0
        if value & 1:
            observe.until(lambda: bool(task_queue))
        return value

    def give_up(message):
        for future, _ in again:
            future.set_exception(BrokenExecutor(message))
        again.clear()
        if pool is not None:
            pool.broken(message)

    try:
        while True:
            if workers.epoch != seen[0]:
                reclaim()
            if not workers.alive and not pending:
                if grow is not None and not grow.stopped and grow.spawn(workers):
                    continue
                if again or not stopping:
                    dead = len(workers.dead)
                    give_up(
                        f"all {dead} workers of the pool were lost and no other can be had"
                    )
                break
            seen_value = look()
            if seen_value & 2:
                backoff.reset()
                grow.spawn(workers)
                continue
            if workers and again:
                backoff.reset()
                send(again.popleft())
                continue
            if seen_value & 1:
                backoff.reset()
                try:
                    item = task_queue.pop()
                except LookupError:  # pragma: no cover
                    item = False
                if item is None:
                    stopping = True
                elif item is not False:
                    future = item[0]
                    if future.set_running_or_notify_cancel():
                        send(item)
                    del future
                del item
                continue
            if pending and poll():
                backoff.reset()
                continue
            if stopping and not pending and not again:
                break
            backoff.sleep()
    finally:
        _report(exref, counts[0], len(lost_here))
        if counts[0]:
            sys.stderr.write(
                f"mpi4py.futures: {counts[0]} tasks re-dispatched after "
                f"{len(lost_here)} workers were lost\n"
            )
            sys.stderr.flush()


def client_stop(comm, workers=None):
    # vpool: the live workers are told to stop and to free the intercommunicator, and so
    # does the client: a Disconnect's barrier (and a synchronous send of the stop) would fail
    # at a lost worker or, in a transparent job, wait for it forever. Standard sends are
    # eager in vpool's MPI: nothing is left to wait for.
    k = 0
    if workers is not None:
        k = next((k for k, c in workers.comms.items() if c is comm), 0)
    for pid in range(comm.Get_remote_size()):
        if workers is not None and (k, pid) not in workers.alive:
            continue
        try:
            serialized(comm.send)(STOP_FREE, pid, 0)
        except MPI.Exception as exc:
            if not _is_failure(exc):
                raise
    serialized(comm.Free)()


def server_sync(comm, sync=True):
    barrier(comm)
    options = bcast_recv(comm)
    if sync:
        options = _sync_set_data(options)
    comm = _get_comm(comm, options)
    return comm, options


def server_init(comm):
    options = bcast_recv(comm)
    success = initialize(options)
    sbuf = bytearray([success])
    rbuf = bytearray([True])
    comm.Allreduce(sbuf, rbuf, op=MPI.LAND)
    return success


def server_exec(comm, options):
    backoff = Backoff(_getopt_backoff(options))

    status = MPI.Status()
    comm_recv = comm.recv
    comm_isend = comm.issend
    comm_iprobe = comm.iprobe
    request_test = _get_request(comm).test

    def exception():
        exc = sys_exception()
        tb = _format_exc(exc, comm)
        return _wrap_exc(exc, tb)

    def recv():
        pid, tag = MPI.ANY_SOURCE, MPI.ANY_TAG
        backoff.reset()
        while not comm_iprobe(pid, tag, status):
            backoff.sleep()
        pid, tag = status.source, status.tag
        try:
            task = comm_recv(None, pid, tag, status)
        except BaseException:
            task = exception()
        return task

    def call(task):
        if isinstance(task, BaseException):
            return (None, task)
        func, args, kwargs = task
        try:
            result = func(*args, **kwargs)
        except BaseException:
            return (None, exception())
        else:
            return (result, None)

    def send(task):
        pid, tag = status.source, status.tag
        try:
            request = comm_isend(task, pid, tag)
        except BaseException:
            task = (None, exception())
            request = comm_isend(task, pid, tag)
        backoff.reset()
        while not request_test(request)[0]:
            backoff.sleep()

    while True:
        task = recv()
        if task is None:
            break
        if isinstance(task, str) and task == STOP_FREE:  # vpool
            return True
        task = call(task)
        send(task)
    return False


def server_stop(comm, free=False):
    if free:  # vpool: the client lost workers and frees the intercommunicator too
        comm.Free()
        return
    disconnect(comm)


# ---

MAIN_RUN_NAME = "__worker__"


def import_main(mod_name, mod_path, init_globals, run_name):
    import runpy
    import types

    module = types.ModuleType(run_name)
    if init_globals is not None:
        module.__dict__.update(init_globals)
        module.__name__ = run_name

    class TempModulePatch(runpy._TempModule):
        # pylint: disable=too-few-public-methods
        def __init__(self, mod_name):
            super().__init__(mod_name)
            self.module = module

    TempModule = runpy._TempModule  # pylint: disable=invalid-name
    runpy._TempModule = TempModulePatch
    import_main.sentinel = (mod_name, mod_path)
    main_module = sys.modules["__main__"]
    try:
        sys.modules["__main__"] = sys.modules[run_name] = module
        if mod_name:  # pragma: no cover
            runpy.run_module(mod_name, run_name=run_name, alter_sys=True)
        elif mod_path:  # pragma: no branch
            safe_path = getattr(sys.flags, "safe_path", sys.flags.isolated)
            if not safe_path:  # pragma: no branch
                dir_path = os.path.dirname(mod_path)  # noqa: PTH120
                sys.path[0] = os.path.realpath(dir_path)
            runpy.run_path(mod_path, run_name=run_name)
        sys.modules["__main__"] = sys.modules[run_name] = module
    except BaseException:  # pragma: no cover
        sys.modules["__main__"] = main_module
        raise
    finally:
        del import_main.sentinel
        runpy._TempModule = TempModule


def _sync_get_data(options):
    main = sys.modules["__main__"]
    sys.modules.setdefault(MAIN_RUN_NAME, main)
    import_main_module = options.pop("main", True)

    data = options.copy()
    data.pop("initializer", None)
    data.pop("initargs", None)
    data.pop("initkwargs", None)

    if import_main_module:
        spec = getattr(main, "__spec__", None)
        name = getattr(spec, "name", None)
        path = getattr(main, "__file__", None)
        if name is not None:  # pragma: no cover
            data["@main:mod_name"] = name
        if path is not None:  # pragma: no branch
            data["@main:mod_path"] = path

    return data


def _sync_set_data(data):
    if "path" in data:
        sys.path.extend(data.pop("path"))
    if "wdir" in data:
        os.chdir(data.pop("wdir"))
    if "env" in data:
        os.environ.update(data.pop("env"))

    mod_name = data.pop("@main:mod_name", None)
    mod_path = data.pop("@main:mod_path", None)
    mod_glbs = data.pop("globals", None)
    import_main(mod_name, mod_path, mod_glbs, MAIN_RUN_NAME)

    return data


def _init_get_data(options):
    keys = ("initializer", "initargs", "initkwargs")
    vals = (None, (), {})
    data = {k: options.pop(k, v) for k, v in zip(keys, vals)}
    return data


# ---


def _check_recursive_spawn():  # pragma: no cover
    if not hasattr(import_main, "sentinel"):
        return
    main_name, main_path = import_main.sentinel
    main_info = "\n"
    if main_name is not None:
        main_info += f"    main name: {main_name!r}\n"
    if main_path is not None:
        main_info += f"    main path: {main_path!r}\n"
    main_info += "\n"
    sys.stderr.write(
        """
    The main script or module attempted to spawn new MPI worker processes.
    This probably means that you have forgotten to use the proper idiom in
    your main script or module:

        if __name__ == '__main__':
            ...

    This error is unrecoverable. The MPI execution environment had to be
    aborted. The name/path of the offending main script/module follows:
    """
        + main_info
    )
    sys.stderr.flush()
    time.sleep(1)
    MPI.COMM_WORLD.Abort(1)


FLAG_OPT_MAP = {
    "debug": "d",
    "inspect": "i",
    "interactive": "i",
    "optimize": "O",
    "dont_write_bytecode": "B",
    "no_user_site": "s",
    "no_site": "S",
    "ignore_environment": "E",
    "verbose": "v",
    "bytes_warning": "b",
    "quiet": "q",
    "hash_randomization": "R",
    "isolated": "I",
    # 'dev_mode': 'Xdev',
    # 'utf8_mode': 'Xutf8',
    # 'warn_default_encoding': 'Xwarn_default_encoding',
    "safe_path": "P",
    # 'int_max_str_digits': 'Xint_max_str_digits=0'
}


def get_python_flags():
    args = []
    for flag, opt in FLAG_OPT_MAP.items():
        val = getattr(sys.flags, flag, 0)
        val = val if opt[0] != "i" else 0
        val = val if opt[0] != "Q" else min(val, 1)
        if val > 0:
            args.append("-" + opt * val)
    for opt in sys.warnoptions:  # pragma: no cover
        args.append("-W" + opt)
    sys_xoptions = getattr(sys, "_xoptions", {})
    for opt, val in sys_xoptions.items():  # pragma: no cover
        args.append("-X" + opt if val is True else "-X" + opt + "=" + val)
    return args


def get_max_workers():
    max_workers = os_environ_get("MAX_WORKERS")
    if max_workers is not None:
        return int(max_workers)
    if MPI.UNIVERSE_SIZE != MPI.KEYVAL_INVALID:  # pragma: no branch
        universe_size = MPI.COMM_WORLD.Get_attr(MPI.UNIVERSE_SIZE)
        if universe_size is not None:  # pragma: no cover
            world_size = MPI.COMM_WORLD.Get_size()
            return max(universe_size - world_size, 1)
    return 1


def get_spawn_module():
    return __spec__.parent + ".server"


def client_spawn(
    python_exe=None,
    python_args=None,
    max_workers=None,
    mpi_info=None,
):
    _check_recursive_spawn()
    if python_exe is None:
        python_exe = sys.executable
    if python_args is None:
        python_args = []
    if max_workers is None:
        max_workers = get_max_workers()
    if mpi_info is None:
        mpi_info = {"soft": f"1:{max_workers}"}

    args = get_python_flags() + list(python_args)
    args.extend(["-m", get_spawn_module()])
    info = MPI.Info.Create()
    info.update(mpi_info)
    comm = MPI.COMM_SELF.Spawn(python_exe, args, max_workers, info)
    info.Free()
    return comm


# ---


SERVICE = __spec__.parent
SERVER_HOST = "localhost"
SERVER_BIND = ""
SERVER_PORT = 31415


def get_service():
    return os_environ_get("SERVICE", SERVICE)


def get_server_host():
    return os_environ_get("SERVER_HOST", SERVER_HOST)


def get_server_bind():
    return os_environ_get("SERVER_BIND", SERVER_BIND)


def get_server_port():
    return int(os_environ_get("SERVER_PORT", SERVER_PORT))


def client_lookup(address):
    from socket import socket

    host, port = address
    host = host or get_server_host()
    port = port or get_server_port()
    address = (host, int(port))
    sock = socket()
    sock.connect(address)
    try:
        fdes = sock.fileno()
        peer = MPI.Comm.Join(fdes)
    finally:
        sock.close()
    mpi_port = peer.recv(None, 0)
    peer.Disconnect()
    return mpi_port


def server_publish(address, mpi_port):
    from socket import SO_REUSEADDR, SOL_SOCKET, socket

    host, port = address
    host = host or get_server_bind()
    port = port or get_server_port()
    address = (host, int(port))
    serversock = socket()
    serversock.setsockopt(SOL_SOCKET, SO_REUSEADDR, 1)
    serversock.bind(address)
    serversock.listen(0)
    try:
        sock = serversock.accept()[0]
    finally:
        serversock.close()
    try:
        fdes = sock.fileno()
        peer = MPI.Comm.Join(fdes)
    finally:
        sock.close()
    peer.send(mpi_port, 0)
    peer.Disconnect()


def client_connect(service, mpi_info=None):
    info = MPI.INFO_NULL
    if mpi_info:
        info = MPI.Info.Create()
        info.update(mpi_info)
    if not isinstance(service, (list, tuple)):
        service = service or get_service()
        port = MPI.Lookup_name(service, info)
    else:
        port = client_lookup(service)

    comm = MPI.COMM_SELF.Connect(port, info, root=0)
    if info != MPI.INFO_NULL:
        info.Free()
    return comm


def server_accept(
    service,
    mpi_info=None,
    comm=MPI.COMM_WORLD,
    root=0,
):
    info = MPI.INFO_NULL
    if comm.Get_rank() == root:
        if mpi_info:
            info = MPI.Info.Create()
            info.update(mpi_info)
    port = None
    if comm.Get_rank() == root:
        port = MPI.Open_port(info)
    if comm.Get_rank() == root:
        if not isinstance(service, (list, tuple)):
            service = service or get_service()
            MPI.Publish_name(service, port, info)
        else:
            server_publish(service, port)
            service = None

    comm = comm.Accept(port, info, root)
    if port is not None:
        if service is not None:
            MPI.Unpublish_name(service, port, info)
        MPI.Close_port(port)
    if info != MPI.INFO_NULL:
        info.Free()
    return comm


# ---


def get_comm_server():
    try:
        return _tls.comm_server
    except AttributeError:
        raise RuntimeError(
            "communicator is not accessible",
        ) from None


def set_comm_server(intracomm):
    _tls.comm_server = intracomm


def del_comm_server():
    del _tls.comm_server


def server_main_comm(comm, sync=True):
    assert comm != MPI.COMM_NULL  # noqa: S101
    assert comm.Is_inter()  # noqa: S101
    assert comm.Get_remote_size() == 1  # noqa: S101
    comm, options = server_sync(comm, sync)
    server_init(comm)
    free = server_exec(comm, options)  # vpool: free
    server_stop(comm, free)


def server_main_spawn():
    comm = MPI.Comm.Get_parent()
    set_comm_server(MPI.COMM_WORLD)
    server_main_comm(comm)
    del_comm_server()


def server_main_service():
    from getopt import getopt

    longopts = ["bind=", "port=", "service=", "info="]
    optlist, _ = getopt(sys.argv[1:], "", longopts)
    optdict = {opt[2:]: val for opt, val in optlist}

    if "bind" in optdict or "port" in optdict:
        bind = optdict.get("bind") or get_server_bind()
        port = optdict.get("port") or get_server_port()
        service = (bind, int(port))
    else:
        service = optdict.get("service") or get_service()
    info = optdict.get("info", "").split(",")
    info = dict(k_v.split("=", 1) for k_v in info if k_v)

    comm = server_accept(service, info)
    set_comm_server(MPI.COMM_WORLD)
    server_main_comm(comm)
    del_comm_server()


def server_main():
    from ..run import set_abort_status

    try:
        comm = MPI.Comm.Get_parent()
        if comm != MPI.COMM_NULL:
            server_main_spawn()
        else:
            server_main_service()
    except BaseException:
        set_abort_status(1)
        raise


# ---
