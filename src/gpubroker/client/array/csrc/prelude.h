// The prelude of every generated kernel: one source compiles as CUDA C (NVRTC) and as OpenCL C.
// KERNEL, GLOBAL, SHARED and FN mark a kernel, device memory, work-group memory and a helper function; GID and
// GSIZE are a work-item's global index and the grid's size, LID, GROUP and NGROUPS its index in its work-group,
// its work-group's index and the number of work-groups; SYNC() is a work-group barrier. I8 ... U64, F32, F64 name
// the dtypes' C types (C64 and C128, the complex ones, are structs of complex.h). GB_INF and GB_NAN are float
// constants every compiler folds; GB_PI_2, GB_PI_4 and GB_LN2 are pi/2, pi/4 and log(2). GB_WARP_TREE: a tree
// combining a work-group's shares leaves its steps of at most this many pairs to one warp (CUDA: 16; OpenCL: 0).
// (Lines beginning with // at the top of a file of csrc/ describe it and are not part of the source.)

#ifdef __OPENCL_VERSION__
#define KERNEL __kernel
#define GLOBAL __global
#define SHARED __local
#define FN static inline
#define GID ((long)get_global_id(0))
#define GSIZE ((long)get_global_size(0))
#define LID ((int)get_local_id(0))
#define GROUP ((long)get_group_id(0))
#define NGROUPS ((long)get_num_groups(0))
#define SYNC() barrier(CLK_LOCAL_MEM_FENCE)
#define I8 char
#define U8 uchar
#define I16 short
#define U16 ushort
#define I32 int
#define U32 uint
#define I64 long
#define U64 ulong
#define GB_INF ((float)INFINITY)
#define GB_NAN ((float)NAN)
#define GB_WARP_TREE 0
#else
#define KERNEL extern "C" __global__
#define GLOBAL
#define SHARED __shared__
#define FN static __device__ __forceinline__
#define GID ((long long)blockIdx.x * blockDim.x + threadIdx.x)
#define GSIZE ((long long)gridDim.x * blockDim.x)
#define LID ((int)threadIdx.x)
#define GROUP ((long long)blockIdx.x)
#define NGROUPS ((long long)gridDim.x)
#define SYNC() __syncthreads()
#define I8 signed char
#define U8 unsigned char
#define I16 short
#define U16 unsigned short
#define I32 int
#define U32 unsigned int
#define I64 long long
#define U64 unsigned long long
#define GB_INF __int_as_float(0x7f800000)
#define GB_NAN __int_as_float(0x7fffffff)
#define GB_WARP_TREE 16
#endif
#define F32 float
#define F64 double
#define GB_PI_2 1.570796326794896619231321691639751442
#define GB_PI_4 0.785398163397448309615660845819875721
#define GB_LN2 0.693147180559945309417232121458176568
