/* The CUDA driver API's types and struct layouts (cuda.h of CUDA 12.x, x86-64 /
 * aarch64 LP64) that both of nvctk's CUDA sides use: the libvgpu interposer, which
 * ships and so owns this header (libvgpu/src/cuda_min.h includes it), and the
 * simulated driver (nvctk/sim/csrc/cuda_types.h includes it beside its enums and
 * entry points; nvctk/sim/build.py compiles with -I to this directory, or to the
 * wheel's copy, nvctk/lib/include). One copy, so the driver and the interposer
 * cannot disagree about a layout.
 *
 * Needs no generated header: a field typed by a CUDA enum is declared `int` (an
 * enum whose values fit an int is int-sized and int-aligned on these ABIs, so the
 * layout is cuda.h's), with the enum named beside it; the enums' values are in
 * cuda_types.h's cuda_enums.h for the driver and cuda_min.h's defines for libvgpu.
 */
#ifndef NVCTK_CUDA_ABI_H
#define NVCTK_CUDA_ABI_H

#include <stddef.h>
#include <stdint.h>

/* ---- scalar and handle types ---- */

typedef uint32_t cuuint32_t;
typedef uint64_t cuuint64_t;
typedef unsigned long long CUdeviceptr; /* CUdeviceptr_v2: 64-bit since CUDA 3.2 */
typedef int CUdevice;
typedef unsigned long long CUmemGenericAllocationHandle;

typedef struct CUctx_st *CUcontext;
typedef struct CUmod_st *CUmodule;
typedef struct CUfunc_st *CUfunction;
typedef struct CUkern_st *CUkernel;
typedef struct CUlib_st *CUlibrary;
typedef struct CUarray_st *CUarray;
typedef struct CUmipmappedArray_st *CUmipmappedArray;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;
typedef struct CUmemPoolHandle_st *CUmemoryPool;
typedef struct CUgraph_st *CUgraph;
typedef struct CUgraphNode_st *CUgraphNode;
typedef struct CUgraphExec_st *CUgraphExec;

typedef struct CUuuid_st {
    char bytes[16];
} CUuuid;

/* Special stream handles */
#define CU_STREAM_LEGACY ((CUstream)0x1)
#define CU_STREAM_PER_THREAD ((CUstream)0x2)

/* ---- arrays ---- */

typedef struct CUDA_ARRAY_DESCRIPTOR_st {
    size_t Width;
    size_t Height;
    int Format; /* CUarray_format */
    unsigned int NumChannels;
} CUDA_ARRAY_DESCRIPTOR; /* CUDA_ARRAY_DESCRIPTOR_v2 */

typedef struct CUDA_ARRAY3D_DESCRIPTOR_st {
    size_t Width;
    size_t Height;
    size_t Depth;
    int Format; /* CUarray_format */
    unsigned int NumChannels;
    unsigned int Flags;
} CUDA_ARRAY3D_DESCRIPTOR; /* CUDA_ARRAY3D_DESCRIPTOR_v2 */

/* ---- virtual memory management (cuMemCreate & co.) ---- */

typedef struct CUmemLocation_st {
    int type; /* CUmemLocationType */
    int id;
} CUmemLocation;

typedef struct CUmemAllocationProp_st {
    int type;                 /* CUmemAllocationType */
    int requestedHandleTypes; /* CUmemAllocationHandleType */
    CUmemLocation location;
    void *win32HandleMetaData;
    struct {
        unsigned char compressionType;
        unsigned char gpuDirectRDMACapable;
        unsigned short usage;
        unsigned char reserved[4];
    } allocFlags;
} CUmemAllocationProp;

typedef struct CUmemAccessDesc_st {
    CUmemLocation location;
    int flags; /* CUmemAccess_flags */
} CUmemAccessDesc;

/* Stream-ordered allocator */
typedef struct CUmemPoolProps_st {
    int allocType;   /* CUmemAllocationType */
    int handleTypes; /* CUmemAllocationHandleType */
    CUmemLocation location;
    void *win32SecurityAttributes;
    size_t maxSize;
    unsigned short usage;
    unsigned char reserved[54];
} CUmemPoolProps;

/* ---- kernels, launches and graphs ---- */

/* The launch shape every launch struct holds, in this order: grid and block
 * dimensions and the dynamic shared memory (a member list, for the structs below) */
#define CU_LAUNCH_SHAPE                           \
    unsigned int gridDimX, gridDimY, gridDimZ;    \
    unsigned int blockDimX, blockDimY, blockDimZ; \
    unsigned int sharedMemBytes

typedef union CUlaunchAttributeValue_union {
    char pad[64];
} CUlaunchAttributeValue;

typedef struct CUlaunchAttribute_st {
    int id; /* CUlaunchAttributeID */
    char pad[8 - sizeof(int)];
    CUlaunchAttributeValue value;
} CUlaunchAttribute;

typedef struct CUlaunchConfig_st {
    CU_LAUNCH_SHAPE;
    CUstream hStream;
    CUlaunchAttribute *attrs;
    unsigned int numAttrs;
} CUlaunchConfig;

/* What the CUDA 10/11 cuGraphAddKernelNode (no suffix) takes */
typedef struct CUDA_KERNEL_NODE_PARAMS_v1_st {
    CUfunction func;
    CU_LAUNCH_SHAPE;
    void **kernelParams;
    void **extra;
} CUDA_KERNEL_NODE_PARAMS_v1;

/* What cuGraphAddKernelNode_v2 takes (CUDA_KERNEL_NODE_PARAMS in 12.x): v1's fields
 * (the same layout: v1 is the first member), then the kernel and its context */
typedef struct CUDA_KERNEL_NODE_PARAMS_v2_st {
    CUDA_KERNEL_NODE_PARAMS_v1 v1;
    CUkernel kern;
    CUcontext ctx;
} CUDA_KERNEL_NODE_PARAMS;

/* cuLaunchCooperativeKernelMultiDevice's entries */
typedef struct CUDA_LAUNCH_PARAMS_st {
    CUfunction function;
    CU_LAUNCH_SHAPE;
    CUstream hStream;
    void **kernelParams;
} CUDA_LAUNCH_PARAMS;

/* cuGraphAddMemAllocNode's parameters (dptr is returned) */
typedef struct CUDA_MEM_ALLOC_NODE_PARAMS_v1_st {
    CUmemPoolProps poolProps;
    const CUmemAccessDesc *accessDescs;
    size_t accessDescCount;
    size_t bytesize;
    CUdeviceptr dptr;
} CUDA_MEM_ALLOC_NODE_PARAMS;

#endif
