/* tessera._fastcall: the Runner type, one plan's run(): describes the arguments, takes the
 * stream, calls the tessera_run_* function with the GIL released; and time_c_call, the same
 * call repeated for the benchmarks. */
#include "_fastcall.h"

#include <time.h>


/* The allocator's error callback: nothing is kept (the call is handed back to the ctypes path,
 * which allocates through torch and raises torch's own error). */
static void ignore_allocation_error(void* ctx, const char* kind, const char* message) {
  (void)ctx;
  (void)kind;
  (void)message;
}

/* run() without out= on torch: the output is allocated here through the exchange API (about
 * 3 us cheaper than torch.empty_like from Python on CUDA). */
static int can_allocate_output(PyObject* q) {
  PyObject* type = (PyObject*)Py_TYPE(q);
  return torch_exchange != NULL && torch_ready && torch_exchange->managed_tensor_allocator &&
         torch_exchange->managed_tensor_to_py_object_no_sync &&
         (type == torch_type || type == torch_param_type);
}

/* ---- Runner: one plan's run() ---- */

typedef struct {
  PyObject_HEAD
  int op;
  int layout;
  void* function;
  void* plan;
  void* workspace;
  size_t workspace_bytes;
  const DLTensor* index[4]; /* decode/paged: page_indptr, page_indices, last_page_len, qo_indptr
                               (paged prefill); ragged: qo_indptr, kv_indptr */
  PyObject* keep;           /* owners of plan, index descriptors, workspace */
} Runner;

static PyObject* runner_type;

static void runner_dealloc(PyObject* self) {
  PyObject* type = (PyObject*)Py_TYPE(self);
  Py_XDECREF(((Runner*)self)->keep);
  PyObject_Free(self);
  Py_DECREF(type);
}

/* Runners are made by runner() (make_runner) only: Runner() from Python would have no C
 * function or plan. */
static PyObject* runner_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
  PyErr_SetString(PyExc_TypeError,
                  "tessera._fastcall.Runner cannot be created from Python (plan() makes it)");
  return NULL;
}


/* One run() of the runner's plan: describes the arguments, calls the C function `repeat` times
 * (1 for run(); more only for time_c_call, the benchmarks' timing) and, when ns is not NULL,
 * stores the nanoseconds per C call there. The repeat count is an argument, never state of the
 * shared Runner, so a concurrent run() on the same runner calls the C function once.
 * Returns the tessera_status, or -1: not handled, take the ctypes path. */
static PyObject* runner_run(Runner* self, PyObject* args, long repeat, double* ns) {
  if (self->function == NULL || self->plan == NULL) {
    PyErr_SetString(PyExc_TypeError, "tessera._fastcall.Runner without a plan");
    return NULL;
  }
  int ragged = self->op == OP_RAGGED_PREFILL;
  Py_ssize_t expected = ragged ? 5 : 4;
  if (PyTuple_Size(args) != expected) {
    PyErr_Format(PyExc_TypeError, "tessera._fastcall.Runner takes %d positional arguments",
                 (int)expected);
    return NULL;
  }
  desc q, k, v, o, lse;
  PyObject* hold = NULL; /* a list paged_kv_cache as a tuple (paged_kv_of) */
  managed_versioned* allocated = NULL; /* out=None: the output this call allocates */
  PyObject* out_obj = PyTuple_GetItem(args, expected - 2);
  int allocate = out_obj == Py_None;
  int r = 0;
  if (allocate && !can_allocate_output(PyTuple_GetItem(args, 0))) goto decline;
  r = describe(PyTuple_GetItem(args, 0), 0, &q, 0);
  if (r <= 0) goto not_described;
  if (ragged) {
    if ((r = describe(PyTuple_GetItem(args, 1), 0, &k, 0)) <= 0 ||
        (r = describe(PyTuple_GetItem(args, 2), 0, &v, 0)) <= 0)
      goto not_described;
    if (self->layout == TESSERA_KV_LAYOUT_HND && (!hnd_to_nhd(&k) || !hnd_to_nhd(&v)))
      goto decline;
  } else if ((r = paged_kv_of(PyTuple_GetItem(args, 1), &k, &v, 0, &hold)) <= 0) {
    goto not_described;
  }
  PyObject* lse_obj = PyTuple_GetItem(args, expected - 1);
  int have_lse = lse_obj != Py_None;
  if (have_lse && (r = describe(lse_obj, 1, &lse, 0)) <= 0) goto not_described;
  if (allocate) {
    /* Shaped, typed and placed as q (contiguous), as run() allocates it on the ctypes path. */
    DLTensor prototype = q.t;
    if (torch_exchange->managed_tensor_allocator(&prototype, &allocated, NULL,
                                                 ignore_allocation_error) != 0 ||
        allocated == NULL) {
      allocated = NULL;
      if ((r = not_handled()) < 0) goto error;
      goto decline;
    }
    if (!describe_torch_dl(&allocated->dl_tensor, &o)) goto decline;
  } else if ((r = describe(out_obj, 1, &o, 0)) <= 0) {
    goto not_described;
  }

  void* stream = NULL;
  if (q.t.device.device_type == kDLCUDA && torch_exchange_stream) {
    if (torch_exchange->current_work_stream(kDLCUDA, q.t.device.device_id, &stream) != 0)
      goto error; /* its Python exception */
  } else if (q.t.device.device_type == kDLCUDA) {
    if (torch_stream == NULL) goto decline;
    PyObject* index = PyLong_FromLong(q.t.device.device_id);
    if (index == NULL) goto error;
    PyObject* value = PyObject_CallFunctionObjArgs(torch_stream, index, NULL);
    Py_DECREF(index);
    if (value == NULL) goto error; /* the stream getter failed: its error */
    stream = value == Py_None ? NULL : PyLong_AsVoidPtr(value);
    Py_DECREF(value);
    if (stream == NULL && PyErr_Occurred()) goto error;
  }

  const DLTensor* lse_t = have_lse ? &lse.t : NULL;
  tessera_status status = 0;
  struct timespec start, stop;
  if (ns != NULL) {
    *ns = -1.0;
    clock_gettime(CLOCK_MONOTONIC, &start);
  }
  ++calls_served;
  for (long i = 0; i < repeat && status == 0; ++i) {
    if (ragged) {
      run_ragged_prefill_fn run = (run_ragged_prefill_fn)self->function;
      Py_BEGIN_ALLOW_THREADS
      status = run((const tessera_plan*)self->plan, &q.t, &k.t, &v.t, self->index[0],
                   self->index[1], &o.t, lse_t, self->workspace, self->workspace_bytes, stream);
      Py_END_ALLOW_THREADS
    } else {
      tessera_paged_kv kv;
      kv.k_cache = &k.t;
      kv.v_cache = &v.t;
      kv.page_indptr = self->index[0];
      kv.page_indices = self->index[1];
      kv.last_page_len = self->index[2];
      kv.layout = self->layout;
      if (self->op == OP_DECODE) {
        run_decode_fn run = (run_decode_fn)self->function;
        Py_BEGIN_ALLOW_THREADS
        status = run((const tessera_plan*)self->plan, &q.t, &kv, &o.t, lse_t, self->workspace,
                     self->workspace_bytes, stream);
        Py_END_ALLOW_THREADS
      } else {
        run_paged_prefill_fn run = (run_paged_prefill_fn)self->function;
        Py_BEGIN_ALLOW_THREADS
        status = run((const tessera_plan*)self->plan, &q.t, &kv, self->index[3], &o.t, lse_t,
                     self->workspace, self->workspace_bytes, stream);
        Py_END_ALLOW_THREADS
      }
    }
  }
  if (ns != NULL) {
    clock_gettime(CLOCK_MONOTONIC, &stop);
    *ns = ((double)(stop.tv_sec - start.tv_sec) * 1e9 +
           (double)(stop.tv_nsec - start.tv_nsec)) / (double)repeat;
  }
  Py_XDECREF(hold); /* k and v stayed alive until the C function returned */
  if (allocated != NULL && status == 0) {
    /* Success with an allocated output: the tensor itself is the result. */
    void* result = NULL;
    managed_versioned* owned = allocated;
    allocated = NULL;
    if (torch_exchange->managed_tensor_to_py_object_no_sync(owned, &result) != 0 ||
        result == NULL) {
      if (!PyErr_Occurred()) {
        PyErr_SetString(PyExc_RuntimeError, "tessera._fastcall: the output tensor could not "
                                            "be handed to torch");
      }
      return NULL;
    }
    return (PyObject*)result;
  }
  if (allocated != NULL && allocated->deleter != NULL) allocated->deleter(allocated);
  return PyLong_FromLong((long)status);
not_described:
  if (r < 0) goto error;
decline:
  Py_XDECREF(hold);
  if (allocated != NULL && allocated->deleter != NULL) allocated->deleter(allocated);
  ++calls_declined;
  return PyLong_FromLong(-1);
error:
  Py_XDECREF(hold);
  if (allocated != NULL && allocated->deleter != NULL) allocated->deleter(allocated);
  return NULL;
}

/* runner(q, paged_kv_cache, out, lse) / ragged: runner(q, k, v, out, lse); lse may be None. */
static PyObject* runner_call(PyObject* self, PyObject* args, PyObject* kwargs) {
  if (kwargs != NULL && PyDict_Size(kwargs) != 0) {
    PyErr_SetString(PyExc_TypeError, "tessera._fastcall.Runner takes no keyword arguments");
    return NULL;
  }
  return runner_run((Runner*)self, args, 1, NULL);
}

/* time_c_call(runner, repeat, q, ..., out, lse): the runner's call with its C function called
 * `repeat` times (benchmarks: the C ABI's cost inside this process, without the binding);
 * returns (status, nanoseconds per C call). out must be given. */
PyObject* py_time_c_call(PyObject* module, PyObject* args) {
  Py_ssize_t n = PyTuple_Size(args);
  if (n < 2) {
    PyErr_SetString(PyExc_TypeError, "time_c_call(runner, repeat, *arguments)");
    return NULL;
  }
  PyObject* runner = PyTuple_GetItem(args, 0);
  if ((PyObject*)Py_TYPE(runner) != runner_type) {
    PyErr_SetString(PyExc_TypeError, "time_c_call: not a Runner");
    return NULL;
  }
  long repeat = PyLong_AsLong(PyTuple_GetItem(args, 1));
  if (repeat < 1) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "repeat must be >= 1");
    return NULL;
  }
  PyObject* rest = PyTuple_GetSlice(args, 2, n);
  if (rest == NULL) return NULL;
  Py_ssize_t count = PyTuple_Size(rest);
  if (count >= 2 && PyTuple_GetItem(rest, count - 2) == Py_None) {
    Py_DECREF(rest); /* out=None would allocate and return a tensor, not a status */
    PyErr_SetString(PyExc_ValueError, "time_c_call: pass out (the timed call writes into it)");
    return NULL;
  }
  double ns = -1.0;
  PyObject* status = runner_run((Runner*)runner, rest, repeat, &ns);
  Py_DECREF(rest);
  if (status == NULL) return NULL;
  return Py_BuildValue("(Nd)", status, ns);
}

static PyType_Slot runner_slots[] = {
    {Py_tp_dealloc, (void*)runner_dealloc},
    {Py_tp_new, (void*)runner_new},
    {Py_tp_call, (void*)runner_call},
    {Py_tp_doc, (void*)"One plan's run() (made by tessera._fast.runner)."},
    {0, NULL},
};

static PyType_Spec runner_spec = {
    "tessera._fastcall.Runner", sizeof(Runner), 0, Py_TPFLAGS_DEFAULT, runner_slots,
};

static void* address_of(PyObject* value) {
  if (value == Py_None) return NULL;
  return PyLong_AsVoidPtr(value);
}

/* runner(op, function, plan, workspace, workspace_bytes, layout, (index addresses...), keep) */
PyObject* make_runner(PyObject* module, PyObject* args) {
  int op, layout;
  PyObject *function, *plan, *workspace, *indices, *keep;
  unsigned long long workspace_bytes;
  if (!PyArg_ParseTuple(args, "iOOOKiO!O", &op, &function, &plan, &workspace, &workspace_bytes,
                        &layout, &PyTuple_Type, &indices, &keep))
    return NULL;
  Py_ssize_t needed = op == OP_DECODE ? 3 : op == OP_PAGED_PREFILL ? 4 : op == OP_RAGGED_PREFILL ? 2 : -1;
  if (needed < 0 || PyTuple_Size(indices) != needed) {
    PyErr_SetString(PyExc_ValueError, "tessera._fastcall.runner: bad op or index count");
    return NULL;
  }
  Runner* self = PyObject_New(Runner, (PyTypeObject*)runner_type);
  if (self == NULL) return NULL;
  self->keep = NULL;
  self->op = op;
  self->layout = layout;
  self->function = address_of(function);
  self->plan = address_of(plan);
  self->workspace = address_of(workspace);
  self->workspace_bytes = (size_t)workspace_bytes;
  for (int i = 0; i < 4; ++i) self->index[i] = NULL;
  for (Py_ssize_t i = 0; i < needed; ++i) {
    self->index[i] = (const DLTensor*)address_of(PyTuple_GetItem(indices, i));
  }
  Py_INCREF(keep);
  self->keep = keep;
  if (PyErr_Occurred() || self->function == NULL || self->plan == NULL) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "tessera._fastcall.runner: NULL");
    Py_DECREF(self);
    return NULL;
  }
  return (PyObject*)self;
}

int add_runner_type(PyObject* module) {
  runner_type = PyType_FromSpec(&runner_spec);
  if (runner_type == NULL) return -1;
  Py_INCREF(runner_type);
  if (PyModule_AddObject(module, "Runner", runner_type) < 0) {
    Py_DECREF(runner_type);
    return -1;
  }
  return 0;
}
