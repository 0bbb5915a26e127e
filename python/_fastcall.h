/*
 * Private header of tessera._fastcall (python/_fastcall*.c): the limited-API settings, the
 * descriptor and DLPack exchange types, the module state and what one file calls in another.
 *   _fastcall.c           the module: its state, init_numpy / init_torch and the other setters,
 *                         the method table and PyInit__fastcall (the overview is there);
 *   _fastcall_describe.c  numpy / torch objects to DLTensor descriptors (describe), the paged
 *                         K/V split and the HND view, and their Python test entry points;
 *   _fastcall_runner.c    the Runner type: one plan's run() through the C ABI, time_c_call.
 */
#ifndef TESSERA_FASTCALL_H
#define TESSERA_FASTCALL_H

#define Py_LIMITED_API 0x03090000
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>

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

typedef struct {
  DLTensor t;
  int64_t shape[MAX_NDIM];
  int64_t strides[MAX_NDIM];
} desc;

/* ---- module state (_fastcall.c; set by init_numpy / init_torch under the GIL, read-only
 * afterwards) ---- */
extern PyObject* numpy_type; /* numpy.ndarray (exact type only) */
extern Py_ssize_t numpy_head_offset;
extern dtype_entry numpy_dtypes[MAX_DTYPES];
extern int numpy_dtype_count;

extern PyObject* torch_type;        /* torch.Tensor */
extern PyObject* torch_param_type;  /* torch.nn.Parameter */
extern PyObject* torch_strided;     /* torch.strided */
extern PyObject* torch_stream;      /* callable(device_index) -> int (cudaStream_t) */
extern int torch_normalize_strides; /* strides of size-0/1 dims exported as 1 (old torch) */
extern dtype_entry torch_dtypes[MAX_DTYPES];
extern int torch_dtype_count;

extern const exchange_api* torch_exchange; /* NULL: read the tensor's attributes */
extern PyObject* torch_exchange_capsule;   /* owns torch_exchange (a strong reference) */
extern int torch_exchange_stream;          /* use exchange->current_work_stream */
/* run() describes torch tensors only once _fast.py has self-tested the settings init_torch
 * made (enable_torch); describe() (the self-test) reads them regardless. */
extern int torch_ready;

extern PyObject *s_dtype, *s_layout, *s_is_cuda, *s_is_cpu, *s_get_device, *s_data_ptr, *s_shape,
    *s_stride, *s_is_neg;

extern unsigned long long calls_served;   /* run calls that went through this module */
extern unsigned long long calls_declined; /* run calls handed back to the ctypes path */

/* ---- _fastcall_describe.c ---- */

/* 1: described; 0: not handled (nothing pending); -1: an error to raise (see not_handled).
 * any_torch: torch tensors also before enable_torch (describe(), the self-test). */
int describe(PyObject* obj, int writable, desc* d, int any_torch);
/* d from a torch DLTensor as the ctypes path describes the tensor: 1, or 0 (not handled). */
int describe_torch_dl(const DLTensor* tensor, desc* d);
/* K and V of run()'s paged_kv_cache (see its definition for *hold); returns as describe(). */
int paged_kv_of(PyObject* arg, desc* k, desc* v, int any_torch, PyObject** hold);
/* The NHD view of an HND k/v descriptor in place: 1, or 0 when d is not 3-D. */
int hnd_to_nhd(desc* d);
/* 0 after an ordinary exception (dropped) or none; -1 when one stays set to raise. */
int not_handled(void);
PyObject* py_describe(PyObject* module, PyObject* args);
PyObject* py_split_kv(PyObject* module, PyObject* arg);
PyObject* py_hnd_to_nhd(PyObject* module, PyObject* arg);

/* ---- _fastcall_runner.c ---- */

/* Creates the Runner type and adds it to the module as Runner: 0, or -1 with an exception. */
int add_runner_type(PyObject* module);
PyObject* make_runner(PyObject* module, PyObject* args);
PyObject* py_time_c_call(PyObject* module, PyObject* args);

#endif /* TESSERA_FASTCALL_H */
