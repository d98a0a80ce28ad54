// First in a source that uses float64 or complex128: OpenCL C needs the extension enabled (CUDA C has it).
#ifdef __OPENCL_VERSION__
#pragma OPENCL EXTENSION cl_khr_fp64 : enable
#endif
