/*
 * tessera._fastcall: the hot part of the FlashInfer-style wrappers' run() in C (optional).
 *
 * The Python package works without it (python/tessera/wrappers.py calls the C ABI through
 * ctypes); when this module is found next to libtessera.so (python/tessera/_fast.py loads it),
 * run() hands its tensors to a Runner made by plan(), which
 *   - reads each tensor's data pointer, shape, strides, dtype and device through the object's
 *     own Python API (torch: dtype, layout, is_cuda/is_cpu, get_device(), data_ptr(), shape,
 *     stride(); numpy: the PyArrayObject fields, layout checked by _fast.py at load time),
 *     every call (in-place metadata changes such as t_() or resize_() are seen: nothing is
 *     cached per object),
 *   - fills DLTensor structs on the C stack (the same descriptors the ctypes path builds; the
 *     dtype tables are derived from that path at load time and self-tested),
 *   - gets the CUDA stream of a torch CUDA q from the stream getter given at init,
 *   - calls the tessera_run_* function pointer taken from the ctypes binding (no link
 *     dependency on libtessera), with the GIL released as ctypes does.
 * It returns the tessera_status (Python raises through _capi.check, so messages are those of
 * the ctypes path), or -1 when an argument is anything it does not describe exactly like the
 * ctypes path (another framework, a tensor subclass, an unknown dtype or layout, a scalar, a
 * read-only numpy output, ...): run() then takes the ctypes path, which validates and raises.
 *
 * Limited API (abi3, Python >= 3.9): one binary for every CPython 3.9+.
 */
#define Py_LIMITED_API 0x03090000
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>
#include <time.h>

#include <tessera/tessera.h>

/* Bumped when the Python side (_fast.py) and this module must change together. */
#define FASTCALL_VERSION 4
#define MAX_NDIM 8
#define MAX_DTYPES 32
#define NPY_C_CONTIGUOUS 0x1
#define NPY_WRITEABLE 0x400

enum { OP_DECODE = 0, OP_PAGED_PREFILL = 1, OP_RAGGED_PREFILL = 2 };

typedef __typeof__(&tessera_run_decode) run_decode_fn;
typedef __typeof__(&tessera_run_paged_prefill) run_paged_prefill_fn;
typedef __typeof__(&tessera_run_ragged_prefill) run_ragged_prefill_fn;

_Static_assert(sizeof(Py_ssize_t) == sizeof(int64_t), "64-bit platforms only");

typedef struct {
  PyObject* key; /* a dtype object, compared by identity (a strong reference) */
  uint8_t code;
  uint8_t bits;
  int64_t itemsize;
} dtype_entry;

/* The leading fields of numpy's PyArrayObject after PyObject_HEAD (numpy's ABI since 1.7;
 * _fast.py checks describe() against the ctypes path before enabling numpy). */
typedef struct {
  char* data;
  int nd;
  Py_ssize_t* dimensions;
  Py_ssize_t* strides;
  PyObject* base;
  PyObject* descr;
  int flags;
} numpy_head;

/* ---- module state (set by init_numpy / init_torch under the GIL, read-only afterwards) ---- */
static PyObject* numpy_type;  /* numpy.ndarray (exact type only) */
static Py_ssize_t numpy_head_offset;
static dtype_entry numpy_dtypes[MAX_DTYPES];
static int numpy_dtype_count;

static PyObject* torch_type;      /* torch.Tensor */
static PyObject* torch_param_type; /* torch.nn.Parameter */
static PyObject* torch_strided;   /* torch.strided */
static PyObject* torch_stream;    /* callable(device_index) -> int (cudaStream_t) */
static int torch_normalize_strides; /* strides of size-0/1 dims exported as 1 (old torch) */
static dtype_entry torch_dtypes[MAX_DTYPES];
static int torch_dtype_count;

/* DLPack's C exchange API (dlpack.h 1.3, DLPackExchangeAPI; torch >= 2.10 exposes it as the
 * capsule torch.Tensor.__dlpack_c_exchange_api__): dltensor_from_py_object_no_sync fills a
 * DLTensor of a tensor without allocating, current_work_stream gives the framework's current
 * stream. Declared here because the system dlpack.h may be older (0.6). */
typedef struct exchange_header {
  uint32_t major;
  uint32_t minor;
  struct exchange_header* prev_api;
} exchange_header;
/* DLManagedTensorVersioned of dlpack.h >= 1.0 (what the exchange API's allocator returns). */
typedef struct managed_versioned {
  uint32_t major;
  uint32_t minor;
  void* manager_ctx;
  void (*deleter)(struct managed_versioned* self);
  uint64_t flags;
  DLTensor dl_tensor;
} managed_versioned;
typedef struct {
  exchange_header header;
  /* A new tensor of the prototype's dtype, shape and device from the framework's allocator
   * (torch: torch.empty on the current stream). */
  int (*managed_tensor_allocator)(DLTensor* prototype, managed_versioned** out, void* error_ctx,
                                  void (*set_error)(void* ctx, const char* kind,
                                                    const char* message));
  void* managed_tensor_from_py_object_no_sync;
  /* The framework's Python object of an allocated tensor (takes over its ownership). */
  int (*managed_tensor_to_py_object_no_sync)(managed_versioned* tensor, void** out_py_object);
  int (*dltensor_from_py_object_no_sync)(void* py_object, DLTensor* out);
  int (*current_work_stream)(int device_type, int32_t device_id, void** out_current_stream);
} exchange_api;

static const exchange_api* torch_exchange; /* NULL: read the tensor's attributes */
static PyObject* torch_exchange_capsule;   /* owns torch_exchange (a strong reference) */
static int torch_exchange_stream;          /* use exchange->current_work_stream */
/* run() describes torch tensors only once _fast.py has self-tested the settings init_torch
 * made (enable_torch); describe() (the self-test) reads them regardless. */
static int torch_ready;

static PyObject *s_dtype, *s_layout, *s_is_cuda, *s_is_cpu, *s_get_device, *s_data_ptr, *s_shape,
    *s_stride, *s_is_neg;

static unsigned long long calls_served; /* run calls that went through this module */
static unsigned long long calls_declined; /* run calls handed back to the ctypes path */

typedef struct {
  DLTensor t;
  int64_t shape[MAX_NDIM];
  int64_t strides[MAX_NDIM];
} desc;

static void compact_strides(const DLTensor* t, int64_t* strides);

static const dtype_entry* find_dtype(const dtype_entry* table, int count, PyObject* key) {
  for (int i = 0; i < count; ++i) {
    if (table[i].key == key) return &table[i];
  }
  return NULL;
}

/* 1: described; 0: not handled (nothing pending). */
static int describe_numpy(PyObject* obj, int writable, desc* d) {
  const numpy_head* head = (const numpy_head*)((const char*)obj + numpy_head_offset);
  const dtype_entry* dtype = find_dtype(numpy_dtypes, numpy_dtype_count, head->descr);
  if (dtype == NULL) return 0;
  if (writable && !(head->flags & NPY_WRITEABLE)) return 0; /* ctypes path raises */
  int nd = head->nd;
  if (nd < 1 || nd > MAX_NDIM) return 0;
  d->t.data = head->data;
  d->t.device.device_type = kDLCPU;
  d->t.device.device_id = 0;
  d->t.ndim = nd;
  d->t.dtype.code = dtype->code;
  d->t.dtype.bits = dtype->bits;
  d->t.dtype.lanes = 1;
  for (int i = 0; i < nd; ++i) d->shape[i] = head->dimensions[i];
  d->t.shape = d->shape;
  d->t.byte_offset = 0;
  if (head->flags & NPY_C_CONTIGUOUS) {
    d->t.strides = NULL; /* DLPack: compact row-major */
  } else {
    for (int i = 0; i < nd; ++i) {
      int64_t bytes = head->strides[i];
      if (bytes % dtype->itemsize) return 0; /* ctypes path raises */
      d->strides[i] = bytes / dtype->itemsize;
    }
    d->t.strides = d->strides;
  }
  return 1;
}

static int read_int64_tuple(PyObject* tuple, int64_t* values, Py_ssize_t expected) {
  if (tuple == NULL || !PyTuple_Check(tuple)) return -1;
  Py_ssize_t n = PyTuple_Size(tuple);
  if (expected >= 0 ? n != expected : (n < 1 || n > MAX_NDIM)) return -1;
  for (Py_ssize_t i = 0; i < n; ++i) {
    long long value = PyLong_AsLongLong(PyTuple_GetItem(tuple, i));
    if (value == -1 && PyErr_Occurred()) return -1;
    values[i] = value;
  }
  return (int)n;
}

/* An error while describing: an ordinary exception is dropped (0: the ctypes path redoes the
 * work and raises its own error); KeyboardInterrupt, SystemExit, MemoryError, ... (raised by a
 * torch-function mode, a signal handler, ...) stay set (-1: the call raises it). */
static int not_handled(void) {
  if (PyErr_Occurred() == NULL) return 0;
  if (PyErr_ExceptionMatches(PyExc_Exception) && !PyErr_ExceptionMatches(PyExc_MemoryError)) {
    PyErr_Clear();
    return 0;
  }
  return -1;
}

/* Through the exchange API: one C call; shape/strides are copied (the producer owns them). */
/* d from a torch DLTensor as the ctypes path describes the tensor: 1, or 0 (not handled). */
static int describe_torch_dl(const DLTensor* tensor, desc* d) {
  DLTensor t = *tensor;
  int nd = t.ndim;
  if (nd < 1 || nd > MAX_NDIM) return 0;
  if (t.device.device_type != kDLCPU && t.device.device_type != kDLCUDA) return 0;
  d->t.data = (char*)t.data + t.byte_offset; /* torch's to_dlpack: data_ptr(), offset 0 */
  d->t.device = t.device;
  d->t.ndim = nd;
  d->t.dtype = t.dtype;
  for (int i = 0; i < nd; ++i) d->shape[i] = t.shape[i];
  d->t.shape = d->shape;
  if (t.strides) {
    for (int i = 0; i < nd; ++i) d->strides[i] = t.strides[i];
  } else {
    compact_strides(&d->t, d->strides);
  }
  if (torch_normalize_strides) {
    for (int i = 0; i < nd; ++i) {
      if (d->shape[i] < 2) d->strides[i] = 1;
    }
  }
  d->t.strides = d->strides;
  d->t.byte_offset = 0;
  return 1;
}

static int describe_torch_exchange(PyObject* obj, desc* d) {
  DLTensor t;
  if (torch_exchange->dltensor_from_py_object_no_sync(obj, &t) != 0) return not_handled();
  return describe_torch_dl(&t, d);
}

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

/* A lazy negative view (torch's negative bit: x.conj().imag, torch._neg_view) has the memory of
 * its base, not its values, and neither DLPack mode says so: never described, so the ctypes
 * path refuses it by name. (The conjugate bit exists only on complex dtypes, which no run
 * accepts.) 1: negative view; 0: not; -1: is_neg() failed. */
static int torch_negative_view(PyObject* obj) {
  PyObject* value = PyObject_CallMethodObjArgs(obj, s_is_neg, NULL);
  if (value == NULL) return -1;
  int negative = value == Py_True;
  Py_DECREF(value);
  return negative;
}

static int describe_torch(PyObject* obj, desc* d) {
  int negative = torch_negative_view(obj);
  if (negative != 0) return negative < 0 ? not_handled() : 0;
  if (torch_exchange != NULL) return describe_torch_exchange(obj, d);
  PyObject* value = PyObject_GetAttr(obj, s_dtype);
  if (value == NULL) goto fail;
  const dtype_entry* dtype = find_dtype(torch_dtypes, torch_dtype_count, value);
  Py_DECREF(value);
  if (dtype == NULL) return 0;
  value = PyObject_GetAttr(obj, s_layout);
  if (value == NULL) goto fail;
  int strided = value == torch_strided;
  Py_DECREF(value);
  if (!strided) return 0;
  value = PyObject_GetAttr(obj, s_is_cuda);
  if (value == NULL) goto fail;
  int cuda = value == Py_True;
  Py_DECREF(value);
  if (cuda) {
    value = PyObject_CallMethodObjArgs(obj, s_get_device, NULL);
    if (value == NULL) goto fail;
    long index = PyLong_AsLong(value);
    Py_DECREF(value);
    if (index < 0) goto fail;
    d->t.device.device_type = kDLCUDA;
    d->t.device.device_id = (int32_t)index;
  } else {
    value = PyObject_GetAttr(obj, s_is_cpu);
    if (value == NULL) goto fail;
    int cpu = value == Py_True;
    Py_DECREF(value);
    if (!cpu) return 0; /* meta, xpu, mps, ...: the ctypes path decides */
    d->t.device.device_type = kDLCPU;
    d->t.device.device_id = 0;
  }
  value = PyObject_CallMethodObjArgs(obj, s_data_ptr, NULL);
  if (value == NULL) goto fail;
  void* data = PyLong_AsVoidPtr(value);
  Py_DECREF(value);
  if (data == NULL && PyErr_Occurred()) goto fail;
  value = PyObject_GetAttr(obj, s_shape);
  int nd = read_int64_tuple(value, d->shape, -1);
  Py_XDECREF(value);
  if (nd < 0) goto fail;
  value = PyObject_CallMethodObjArgs(obj, s_stride, NULL);
  int ns = read_int64_tuple(value, d->strides, nd);
  Py_XDECREF(value);
  if (ns < 0) goto fail;
  if (torch_normalize_strides) {
    for (int i = 0; i < nd; ++i) {
      if (d->shape[i] < 2) d->strides[i] = 1;
    }
  }
  d->t.data = data;
  d->t.ndim = nd;
  d->t.dtype.code = dtype->code;
  d->t.dtype.bits = dtype->bits;
  d->t.dtype.lanes = 1;
  d->t.shape = d->shape;
  d->t.strides = d->strides;
  d->t.byte_offset = 0;
  return 1;
fail:
  return not_handled(); /* the ctypes path redoes it and raises its own error */
}

/* 1: described; 0: not handled (nothing pending); -1: an error to raise (see not_handled).
 * any_torch: torch tensors also before enable_torch (describe(), the self-test). */
static int describe(PyObject* obj, int writable, desc* d, int any_torch) {
  PyObject* type = (PyObject*)Py_TYPE(obj);
  if (type == numpy_type && numpy_type != NULL) return describe_numpy(obj, writable, d);
  if ((type == torch_type || type == torch_param_type) && torch_type != NULL &&
      (torch_ready || any_torch)) {
    return describe_torch(obj, d);
  }
  return 0;
}

static int64_t itemsize_of(const DLTensor* t) { return (t->dtype.bits * t->dtype.lanes + 7) / 8; }

static void compact_strides(const DLTensor* t, int64_t* strides) {
  int64_t step = 1;
  for (int i = t->ndim - 1; i >= 0; --i) {
    strides[i] = step;
    step *= t->shape[i] > 1 ? t->shape[i] : 1;
  }
}

/* K and V of one paged-KV tensor [num_pages, 2, ...] (_common.split_combined_kv). */
static int split_combined(const desc* both, desc* k, desc* v) {
  if (both->t.ndim != 5 || both->t.shape[1] != 2) return 0;
  int64_t strides[5];
  if (both->t.strides) {
    memcpy(strides, both->t.strides, sizeof strides);
  } else {
    compact_strides(&both->t, strides);
  }
  for (int which = 0; which < 2; ++which) {
    desc* out = which ? v : k;
    out->t = both->t;
    out->t.ndim = 4;
    for (int i = 0, j = 0; i < 5; ++i) {
      if (i == 1) continue;
      out->shape[j] = both->t.shape[i];
      out->strides[j] = strides[i];
      ++j;
    }
    out->t.shape = out->shape;
    out->t.strides = out->strides;
    out->t.byte_offset = both->t.byte_offset +
                         (uint64_t)(which * strides[1] * itemsize_of(&both->t));
  }
  return 1;
}

/* NHD view of an HND k/v [num_kv_heads, total_kv, head_dim] (wrappers._hnd_to_nhd). */
static int hnd_to_nhd(desc* d) {
  if (d->t.ndim != 3) return 0;
  int64_t strides[3];
  if (d->t.strides) {
    memcpy(strides, d->t.strides, sizeof strides);
  } else {
    compact_strides(&d->t, strides);
  }
  int64_t s0 = d->t.shape[0];
  d->shape[0] = d->t.shape[1];
  d->shape[1] = s0;
  d->shape[2] = d->t.shape[2];
  d->strides[0] = strides[1];
  d->strides[1] = strides[0];
  d->strides[2] = strides[2];
  d->t.shape = d->shape;
  d->t.strides = d->strides;
  return 1;
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

/* K and V of run()'s paged_kv_cache: a (k, v) tuple or list, or one [num_pages, 2, ...] tensor.
 * A list is copied to a tuple first, returned in *hold (a new reference the caller releases
 * after the C call, NULL otherwise): describing k may run Python code (a torch-function mode
 * intercepting the attributes) that empties the list, which would free v under us; the tuple
 * keeps both alive until the C function has returned. Returns as describe(). */
static int paged_kv_of(PyObject* arg, desc* k, desc* v, int any_torch, PyObject** hold) {
  *hold = NULL;
  if (PyList_CheckExact(arg)) {
    if (PyList_Size(arg) != 2) return 0;
    arg = PyList_AsTuple(arg);
    if (arg == NULL) return -1;
    *hold = arg;
  }
  if (PyTuple_CheckExact(arg)) {
    if (PyTuple_Size(arg) != 2) return 0;
    int r = describe(PyTuple_GetItem(arg, 0), 0, k, any_torch);
    if (r <= 0) return r;
    return describe(PyTuple_GetItem(arg, 1), 0, v, any_torch);
  }
  desc both;
  int r = describe(arg, 0, &both, any_torch);
  if (r <= 0) return r;
  return split_combined(&both, k, v);
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
static PyObject* py_time_c_call(PyObject* module, PyObject* args) {
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
static PyObject* make_runner(PyObject* module, PyObject* args) {
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

/* ---- init ---- */

static int fill_table(PyObject* entries, dtype_entry* table, int* count) {
  if (!PyList_Check(entries)) {
    PyErr_SetString(PyExc_TypeError, "expected a list of (dtype, code, bits, itemsize)");
    return -1;
  }
  Py_ssize_t n = PyList_Size(entries);
  if (n > MAX_DTYPES) n = MAX_DTYPES;
  for (int i = 0; i < *count; ++i) Py_CLEAR(table[i].key);
  *count = 0;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* key;
    int code, bits;
    long long itemsize;
    if (!PyArg_ParseTuple(PyList_GetItem(entries, i), "OiiL", &key, &code, &bits, &itemsize))
      return -1;
    if (itemsize <= 0) {
      PyErr_SetString(PyExc_ValueError, "itemsize must be > 0");
      return -1;
    }
    Py_INCREF(key);
    table[*count].key = key;
    table[*count].code = (uint8_t)code;
    table[*count].bits = (uint8_t)bits;
    table[*count].itemsize = itemsize;
    ++*count;
  }
  return 0;
}

/* init_numpy(ndarray_type, head_offset, [(dtype, code, bits, itemsize), ...]) or
 * init_numpy(None) to turn numpy off. */
static PyObject* init_numpy(PyObject* module, PyObject* args) {
  PyObject *type, *entries = NULL;
  Py_ssize_t offset = 0;
  if (!PyArg_ParseTuple(args, "O|nO", &type, &offset, &entries)) return NULL;
  Py_CLEAR(numpy_type);
  if (type == Py_None) Py_RETURN_NONE;
  if (entries == NULL || offset < (Py_ssize_t)sizeof(PyObject)) {
    PyErr_SetString(PyExc_ValueError, "init_numpy(type, head_offset, dtypes)");
    return NULL;
  }
  if (fill_table(entries, numpy_dtypes, &numpy_dtype_count) < 0) return NULL;
  numpy_head_offset = offset;
  Py_INCREF(type);
  numpy_type = type;
  Py_RETURN_NONE;
}

/* init_torch(tensor_type, parameter_type, strided, stream_getter, normalize_strides,
 *            [(dtype, code, bits, itemsize), ...], exchange_capsule=None, exchange_stream=False)
 * or init_torch(None) to turn torch off. Either way run() stops describing torch tensors until
 * enable_torch() (after _fast.py's self-test of these settings through describe()). */
static PyObject* init_torch(PyObject* module, PyObject* args) {
  PyObject *type, *param = NULL, *strided = NULL, *stream = NULL, *entries = NULL,
                  *exchange = Py_None;
  int normalize = 0, exchange_stream = 0;
  if (!PyArg_ParseTuple(args, "O|OOOpOOp", &type, &param, &strided, &stream, &normalize, &entries,
                        &exchange, &exchange_stream))
    return NULL;
  const exchange_api* api = NULL;
  if (exchange != Py_None) {
    api = (const exchange_api*)PyCapsule_GetPointer(exchange, "dlpack_exchange_api");
    if (api == NULL) return NULL;
    if (api->header.major != 1 || api->dltensor_from_py_object_no_sync == NULL ||
        api->current_work_stream == NULL) {
      PyErr_SetString(PyExc_ValueError, "unsupported DLPack exchange API version");
      return NULL;
    }
  }
  torch_ready = 0;
  torch_exchange = NULL;
  torch_exchange_stream = 0;
  Py_CLEAR(torch_exchange_capsule);
  Py_CLEAR(torch_type);
  Py_CLEAR(torch_param_type);
  Py_CLEAR(torch_strided);
  Py_CLEAR(torch_stream);
  if (type == Py_None) Py_RETURN_NONE;
  if (entries == NULL) {
    PyErr_SetString(PyExc_ValueError,
                    "init_torch(type, parameter_type, strided, stream_getter, normalize, dtypes)");
    return NULL;
  }
  if (fill_table(entries, torch_dtypes, &torch_dtype_count) < 0) return NULL;
  torch_normalize_strides = normalize;
  Py_INCREF(param);
  torch_param_type = param;
  Py_INCREF(strided);
  torch_strided = strided;
  if (stream != Py_None) {
    Py_INCREF(stream);
    torch_stream = stream;
  }
  if (api != NULL) {
    Py_INCREF(exchange); /* the capsule owns the function table: keep it while it is used */
    torch_exchange_capsule = exchange;
  }
  torch_exchange = api;
  torch_exchange_stream = api != NULL && exchange_stream;
  Py_INCREF(type);
  torch_type = type;
  Py_RETURN_NONE;
}

/* enable_torch(): run() describes torch tensors with the settings of the last init_torch
 * (once _fast.py's self-test has passed); returns whether torch is on. */
static PyObject* py_enable_torch(PyObject* module, PyObject* unused) {
  torch_ready = torch_type != NULL;
  return PyBool_FromLong(torch_ready);
}

/* stream(device_id, exchange=None): the stream run() passes for a torch CUDA q on that device;
 * exchange=True / False: the stream the exchange API's current_work_stream / the stream getter
 * gives, whatever run() uses now (the self-test checks a setting before it is switched on). */
static PyObject* py_stream(PyObject* module, PyObject* args) {
  PyObject *arg, *mode = Py_None;
  if (!PyArg_ParseTuple(args, "O|O", &arg, &mode)) return NULL;
  long index = PyLong_AsLong(arg);
  if (index == -1 && PyErr_Occurred()) return NULL;
  int exchange = torch_exchange_stream;
  if (mode != Py_None) {
    exchange = PyObject_IsTrue(mode);
    if (exchange < 0) return NULL;
  }
  void* stream = NULL;
  if (exchange) {
    if (torch_exchange == NULL) {
      PyErr_SetString(PyExc_RuntimeError, "tessera._fastcall: no DLPack exchange API");
      return NULL;
    }
    if (torch_exchange->current_work_stream(kDLCUDA, (int32_t)index, &stream) != 0) return NULL;
  } else if (torch_stream != NULL) {
    PyObject* value = PyObject_CallFunctionObjArgs(torch_stream, arg, NULL);
    if (value == NULL) return NULL;
    stream = value == Py_None ? NULL : PyLong_AsVoidPtr(value);
    Py_DECREF(value);
    if (stream == NULL && PyErr_Occurred()) return NULL;
  } else {
    Py_RETURN_NONE;
  }
  return PyLong_FromVoidPtr(stream);
}

/* set_exchange_stream(flag): take torch's current stream from the exchange API (once _fast.py
 * has checked it, through stream(device_id, True), against torch's own getter on a CUDA
 * device) instead of the stream getter. */
static PyObject* py_set_exchange_stream(PyObject* module, PyObject* arg) {
  int flag = PyObject_IsTrue(arg);
  if (flag < 0) return NULL;
  torch_exchange_stream = flag && torch_exchange != NULL;
  return PyBool_FromLong(torch_exchange_stream);
}

static PyObject* py_torch_mode(PyObject* module, PyObject* unused) {
  if (torch_type == NULL) return PyUnicode_FromString("off");
  if (!torch_ready) return PyUnicode_FromString("not enabled");
  return PyUnicode_FromString(torch_exchange == NULL       ? "attributes"
                              : torch_exchange_stream      ? "exchange-api"
                                                           : "exchange-api, stream getter");
}

static PyObject* int64_tuple(const int64_t* values, int n) {
  PyObject* tuple = PyTuple_New(n);
  if (tuple == NULL) return NULL;
  for (int i = 0; i < n; ++i) {
    PyObject* item = PyLong_FromLongLong(values[i]);
    if (item == NULL || PyTuple_SetItem(tuple, i, item) < 0) {
      Py_DECREF(tuple);
      return NULL;
    }
  }
  return tuple;
}

static PyObject* descriptor_tuple(const desc* d) {
  PyObject* shape = int64_tuple(d->t.shape, d->t.ndim);
  if (shape == NULL) return NULL;
  PyObject* strides = d->t.strides ? int64_tuple(d->t.strides, d->t.ndim) : (Py_INCREF(Py_None), Py_None);
  if (strides == NULL) {
    Py_DECREF(shape);
    return NULL;
  }
  return Py_BuildValue("(KiiiiiiNNK)", (unsigned long long)(uintptr_t)d->t.data,
                       (int)d->t.device.device_type, (int)d->t.device.device_id, (int)d->t.ndim,
                       (int)d->t.dtype.code, (int)d->t.dtype.bits, (int)d->t.dtype.lanes, shape,
                       strides, (unsigned long long)d->t.byte_offset);
}

/* describe(obj, writable=False): the descriptor run() would pass, as (data, device_type,
 * device_id, ndim, code, bits, lanes, shape, strides or None, byte_offset), or None when the
 * fast path does not handle obj (self-test and tests; torch tensors are described with the
 * settings of init_torch also before enable_torch). */
static PyObject* py_describe(PyObject* module, PyObject* args) {
  PyObject* obj;
  int writable = 0;
  if (!PyArg_ParseTuple(args, "O|p", &obj, &writable)) return NULL;
  desc d;
  int r = describe(obj, writable, &d, 1);
  if (r < 0) return NULL;
  if (r == 0) Py_RETURN_NONE;
  return descriptor_tuple(&d);
}

/* split_kv(paged_kv_cache) / hnd_to_nhd(obj): the derived descriptors (tests). */
static PyObject* py_split_kv(PyObject* module, PyObject* arg) {
  desc k, v;
  PyObject* hold;
  int r = paged_kv_of(arg, &k, &v, 1, &hold);
  Py_XDECREF(hold);
  if (r < 0) return NULL;
  if (r == 0) Py_RETURN_NONE;
  return Py_BuildValue("(NN)", descriptor_tuple(&k), descriptor_tuple(&v));
}

static PyObject* py_hnd_to_nhd(PyObject* module, PyObject* arg) {
  desc d;
  int r = describe(arg, 0, &d, 1);
  if (r < 0) return NULL;
  if (r == 0 || !hnd_to_nhd(&d)) Py_RETURN_NONE;
  return descriptor_tuple(&d);
}

static PyObject* py_stats(PyObject* module, PyObject* unused) {
  return Py_BuildValue("(KK)", calls_served, calls_declined);
}

static PyMethodDef methods[] = {
    {"runner", make_runner, METH_VARARGS,
     "runner(op, function, plan, workspace, workspace_bytes, layout, indices, keep)"},
    {"init_numpy", init_numpy, METH_VARARGS, "init_numpy(ndarray, head_offset, dtypes)"},
    {"init_torch", init_torch, METH_VARARGS,
     "init_torch(Tensor, Parameter, strided, stream_getter, normalize_strides, dtypes)"},
    {"describe", py_describe, METH_VARARGS, "describe(obj, writable=False)"},
    {"split_kv", py_split_kv, METH_O, "split_kv(paged_kv_cache)"},
    {"hnd_to_nhd", py_hnd_to_nhd, METH_O, "hnd_to_nhd(obj)"},
    {"enable_torch", py_enable_torch, METH_NOARGS,
     "enable_torch(): run() reads torch tensors (after the self-test of init_torch's settings)"},
    {"stream", py_stream, METH_VARARGS, "stream(device_id, exchange=None)"},
    {"time_c_call", py_time_c_call, METH_VARARGS, "time_c_call(runner, repeat, *arguments)"},
    {"set_exchange_stream", py_set_exchange_stream, METH_O, "set_exchange_stream(flag)"},
    {"torch_mode", py_torch_mode, METH_NOARGS, "how torch tensors are read"},
    {"stats", py_stats, METH_NOARGS, "(calls served, calls handed back to the ctypes path)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_fastcall", "tessera's run() fast path (see _fastcall.c).", -1,
    methods, NULL, NULL, NULL, NULL,
};

static PyObject* intern(const char* text) { return PyUnicode_InternFromString(text); }

PyMODINIT_FUNC PyInit__fastcall(void) {
  PyObject* module = PyModule_Create(&module_def);
  if (module == NULL) return NULL;
  runner_type = PyType_FromSpec(&runner_spec);
  if (runner_type == NULL) goto error;
  Py_INCREF(runner_type);
  if (PyModule_AddObject(module, "Runner", runner_type) < 0) {
    Py_DECREF(runner_type);
    goto error;
  }
  s_dtype = intern("dtype");
  s_layout = intern("layout");
  s_is_cuda = intern("is_cuda");
  s_is_cpu = intern("is_cpu");
  s_get_device = intern("get_device");
  s_data_ptr = intern("data_ptr");
  s_shape = intern("shape");
  s_stride = intern("stride");
  s_is_neg = intern("is_neg");
  if (!s_dtype || !s_layout || !s_is_cuda || !s_is_cpu || !s_get_device || !s_data_ptr ||
      !s_shape || !s_stride || !s_is_neg)
    goto error;
  if (PyModule_AddIntConstant(module, "VERSION", FASTCALL_VERSION) < 0 ||
      PyModule_AddIntConstant(module, "ABI_VERSION", TESSERA_ABI_VERSION) < 0 ||
      PyModule_AddIntConstant(module, "MAX_NDIM", MAX_NDIM) < 0 ||
      PyModule_AddIntConstant(module, "OP_DECODE", OP_DECODE) < 0 ||
      PyModule_AddIntConstant(module, "OP_PAGED_PREFILL", OP_PAGED_PREFILL) < 0 ||
      PyModule_AddIntConstant(module, "OP_RAGGED_PREFILL", OP_RAGGED_PREFILL) < 0)
    goto error;
  return module;
error:
  Py_DECREF(module);
  return NULL;
}
