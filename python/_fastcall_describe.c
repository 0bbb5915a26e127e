/* tessera._fastcall: numpy arrays and torch tensors to the DLTensor descriptors the ctypes path
 * builds (describe), the K/V of a paged cache and the NHD view of HND k/v, and the module
 * functions that return those descriptors to Python (the self-test and tests). */
#include "_fastcall.h"

#include <string.h>

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
int not_handled(void) {
  if (PyErr_Occurred() == NULL) return 0;
  if (PyErr_ExceptionMatches(PyExc_Exception) && !PyErr_ExceptionMatches(PyExc_MemoryError)) {
    PyErr_Clear();
    return 0;
  }
  return -1;
}

/* Through the exchange API: one C call; shape/strides are copied (the producer owns them). */
/* d from a torch DLTensor as the ctypes path describes the tensor: 1, or 0 (not handled). */
int describe_torch_dl(const DLTensor* tensor, desc* d) {
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
int describe(PyObject* obj, int writable, desc* d, int any_torch) {
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
int hnd_to_nhd(desc* d) {
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

/* K and V of run()'s paged_kv_cache: a (k, v) tuple or list, or one [num_pages, 2, ...] tensor.
 * A list is copied to a tuple first, returned in *hold (a new reference the caller releases
 * after the C call, NULL otherwise): describing k may run Python code (a torch-function mode
 * intercepting the attributes) that empties the list, which would free v under us; the tuple
 * keeps both alive until the C function has returned. Returns as describe(). */
int paged_kv_of(PyObject* arg, desc* k, desc* v, int any_torch, PyObject** hold) {
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
PyObject* py_describe(PyObject* module, PyObject* args) {
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
PyObject* py_split_kv(PyObject* module, PyObject* arg) {
  desc k, v;
  PyObject* hold;
  int r = paged_kv_of(arg, &k, &v, 1, &hold);
  Py_XDECREF(hold);
  if (r < 0) return NULL;
  if (r == 0) Py_RETURN_NONE;
  return Py_BuildValue("(NN)", descriptor_tuple(&k), descriptor_tuple(&v));
}

PyObject* py_hnd_to_nhd(PyObject* module, PyObject* arg) {
  desc d;
  int r = describe(arg, 0, &d, 1);
  if (r < 0) return NULL;
  if (r == 0 || !hnd_to_nhd(&d)) Py_RETURN_NONE;
  return descriptor_tuple(&d);
}
