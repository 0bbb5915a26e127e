/*
 * tessera._fastcall: the hot part of the FlashInfer-style wrappers' run() in C (optional).
 *
 * The Python package works without it (python/tessera/wrappers/ calls the C ABI through
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
 *
 * Files: this one (the module: its state, the init_* setters, the method table, PyInit); the
 * descriptors in _fastcall_describe.c; the Runner in _fastcall_runner.c; what they share in
 * _fastcall.h.
 */
#include "_fastcall.h"

/* ---- module state (set by init_numpy / init_torch under the GIL, read-only afterwards) ---- */
PyObject* numpy_type; /* numpy.ndarray (exact type only) */
Py_ssize_t numpy_head_offset;
dtype_entry numpy_dtypes[MAX_DTYPES];
int numpy_dtype_count;

PyObject* torch_type;        /* torch.Tensor */
PyObject* torch_param_type;  /* torch.nn.Parameter */
PyObject* torch_strided;     /* torch.strided */
PyObject* torch_stream;      /* callable(device_index) -> int (cudaStream_t) */
int torch_normalize_strides; /* strides of size-0/1 dims exported as 1 (old torch) */
dtype_entry torch_dtypes[MAX_DTYPES];
int torch_dtype_count;

const exchange_api* torch_exchange; /* NULL: read the tensor's attributes */
PyObject* torch_exchange_capsule;   /* owns torch_exchange (a strong reference) */
int torch_exchange_stream;          /* use exchange->current_work_stream */
/* run() describes torch tensors only once _fast.py has self-tested the settings init_torch
 * made (enable_torch); describe() (the self-test) reads them regardless. */
int torch_ready;

PyObject *s_dtype, *s_layout, *s_is_cuda, *s_is_cpu, *s_get_device, *s_data_ptr, *s_shape,
    *s_stride, *s_is_neg;

unsigned long long calls_served;   /* run calls that went through this module */
unsigned long long calls_declined; /* run calls handed back to the ctypes path */

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
  if (add_runner_type(module) < 0) goto error;
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
