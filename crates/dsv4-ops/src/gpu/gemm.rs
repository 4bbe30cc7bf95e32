//! The prefill GEMM (`kernels/gemm.cu`): what [`super::gemv`]'s launchers run for more than
//! [`MAX_M`] activation rows, and what [`super::moe::moe_chunk`] runs over each expert's rows.
//! The same weights (the GEMV's packed tiles, every format), the same products on the same
//! MMAs, but each weight byte is read once per 64 rows and each warp sums its tile's whole K in
//! registers (no split, no workspace), so a row's result depends only on its own activations,
//! never on how many rows share the launch. On sm_90a, FP8 launches instead split their
//! activations into the GEMV workspace and run on e4m3 MMAs ([`launch_fp8_tc`],
//! `kernels/gemm_fp8.cu`: other rounding, the same independence of rows), and the routed
//! experts' long FP4 lists run the `_tc` kernels (weights expanded in registers as the A
//! operand of warpgroup MMAs over 128 rows, each weight read once per 128; [`Rows::Lists`]).
//! CPU references:
//! [`super::gemv::reference`], [`super::moe::reference`]; the GPU tests are `tests/gpu_gemv.rs`
//! and `tests/gpu_moe.rs`.

use cudarc::driver::DeviceRepr;

use super::gemv::{pack, GemvFormat, GemvWeight, GemvWorkspace, Output, MAX_M};
use super::launch::{dim_u32, launch_struct};
use super::{Arch, Device, DeviceTensor, GpuError};
use half::bf16;

/// Activation rows of one block (eight MMA column blocks of 8), and of the `_m32` (four) and
/// `_m16` (two) kernels' for expert lists of few rows.
const ROWS: usize = 64;
const SHORT_ROWS: usize = 32;
const FEW_ROWS: usize = 16;
/// Lists averaging at most this many rows a stack take the `_m32` kernels: two of their blocks
/// share a multiprocessor, and at 48 rows an expert (2048 tokens) two 32-row blocks beat one
/// of 64 (12 Flash layers, 8k prompt on an H100: 11,743 against 10,823 tok/s).
const SHORT_LISTS: usize = 64;
/// Lists averaging at most this many rows (a prompt of up to about 420 tokens over 256
/// experts) take the `_m16` kernels. The experts' launches of 4 Flash layers on an H100
/// (Nsight Compute), `_m16` against `_m32`: 150-token prompt 5.04 / 6.20 ms, 384 tokens (9
/// rows an expert) 6.88 / 7.32, 512 (12) 7.78 / 7.74, 680 (16) 9.12 / 8.56.
const FEW_LISTS: usize = 10;
/// Warps of a block, one 16-row weight tile each (`WARPS` in gemm.cu).
const WARPS: usize = 8;
/// List rows of a `_tc` block (`gemm_tc::TOKENS`), and its shared memory: `gemm_tc::STAGES`
/// (4) stages of a 128-column sub-step of them in bf16, and 1 KB to align the swizzled stages.
const TC_ROWS: usize = 128;
const TC_SHARED: usize = 4 * TC_ROWS * 128 * 2 + 1024;
/// Columns of a weight sub-step of FP4 weights: the `_tc` kernels' K is a multiple of it, and
/// their activations are permuted inside each of its spans (`fp4_k_pos` in gemm.cu).
const FP4_SUB_K: usize = 128;

/// Shared memory of a block of `rows`: two slabs of 256 bf16 a row, rows 32 (BF16) or 8 more
/// apart (`KS`, `row_stride` in gemm.cu).
fn shared_bytes(rows: usize, format: &GemvFormat) -> usize {
    let pad = if matches!(format, GemvFormat::Bf16) {
        32
    } else {
        8
    };
    2 * rows * (256 + pad) * 2
}

/// Kernel arguments (mirrors `GemmArgs` in gemm.cu).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct GemmArgs {
    x: u64,
    w: u64,
    s: u64,
    fs0: u64,
    fs1: u64,
    y: u64,
    rows: u64,
    counts: u64,
    g0: u64,
    g1: u64,
    m: u32,
    n: u32,
    k: u32,
    post0: f32,
    post1: f32,
    limit: f32,
    fp8_br: u32,
    tiles: u32,
    y_f32: u32,
    x_ld: u32,
    y_ld: u32,
    x_col_z: u32,
    y_col_z: u32,
    list_stride: u32,
    row_div: u32,
    y_perm: u32,
}

// SAFETY: plain old data with the CUDA struct's layout (checked by a test).
unsafe impl DeviceRepr for GemmArgs {}

/// A stack of weights of one shape in the packed tile layout (a grouped projection's groups, a
/// layer's experts), as the kernel reads it: stack `z` is tiles `[z·T, (z+1)·T)`.
pub(crate) struct Stack {
    pub format: GemvFormat,
    /// Output rows of one stack (gate+up: of h).
    pub n: usize,
    pub k: usize,
    pub gate_up: bool,
    pub codes: u64,
    /// NVFP4/MXFP4 packed scales.
    pub scales: u64,
    /// FP8 scales of W (W1) and W3.
    pub fp8: (u64, u64),
    /// Epilogue multipliers of W (W1) and W3 rows, and per-stack factors of them (0: none).
    pub post: (f32, f32),
    pub factors: (u64, u64),
}

impl Stack {
    fn tiles(&self) -> usize {
        pack::Layout {
            rows: self.n,
            chunks: self.k / self.format.chunk_elems(),
            gate_up: self.gate_up,
        }
        .tiles()
    }
}

/// Which rows each stack takes.
pub(crate) enum Rows<'a> {
    /// Every stack the `m` rows of x and y; stack z reads x columns `[z·K, (z+1)·K)` and
    /// writes y columns `[z·N, (z+1)·N)`.
    Grouped { m: usize },
    /// Stack z the `counts[z]` entries of list z (`lists [stacks, stride]`): entry r reads x
    /// row `r / div` and writes y row r, about `per_stack` entries a list: row blocks of 16, 32
    /// or 64 (FP4 formats; others 64) by that average, as many side by side as it fills.
    Lists {
        lists: &'a DeviceTensor<u32>,
        counts: &'a DeviceTensor<u32>,
        div: usize,
        per_stack: usize,
        /// FP4 weights on the `_tc` kernels (sm_90a, K a multiple of 128): 128-row blocks, x
        /// in their permuted k order (`fp4_k_permute`), and a gate+up's y written in it.
        tensor: bool,
    },
}

/// Whether a chunk's FP4 expert lists (`per_stack` rows each on average; K of each launch in
/// `ks`) run on the `_tc` kernels: on sm_90a, where the lists would take 64-row blocks.
pub(crate) fn fp4_tensor_lists(dev: &Device, per_stack: usize, ks: &[usize]) -> bool {
    dev.arch() == Arch::Sm90a
        && super::gemv::tuning::FP4_TENSOR_GEMM.get()
        && per_stack > SHORT_LISTS
        && ks.iter().all(|k| k.is_multiple_of(FP4_SUB_K))
}

/// The `_tc` kernels' requirements: sm_90a, FP4 weights, K (and a gate+up's N, the permuted h
/// columns) whole sub-steps.
fn check_tensor_lists(arch: Arch, w: &Stack) -> Result<(), GpuError> {
    let why = if arch != Arch::Sm90a {
        format!("need sm_90a, not {arch:?}")
    } else if w.format.chunk_elems() != 32 {
        format!("take FP4 weights, not {:?}", w.format)
    } else if !w.k.is_multiple_of(FP4_SUB_K) || (w.gate_up && !w.n.is_multiple_of(FP4_SUB_K)) {
        format!(
            "take K (and a gate+up's N) in multiples of {FP4_SUB_K}, not K = {}, N = {}",
            w.k, w.n
        )
    } else {
        return Ok(());
    };
    Err(GpuError::invalid(
        "gemm",
        format!("the tensor-core expert kernels {why}"),
    ))
}

/// Checks that `kernel` fits `shared` bytes of dynamic shared memory a block on this GPU (and
/// lets it take them: [`Device::kernel_limits`]).
fn check_shared(dev: &Device, kernel: &str, shared: usize) -> Result<(), GpuError> {
    if shared + dev.kernel_limits(kernel)?.static_shared > dev.max_block_shared() {
        return Err(GpuError::invalid(
            "gemm",
            format!(
                "{kernel} needs {shared} bytes of shared memory a block; this GPU gives {}",
                dev.max_block_shared()
            ),
        ));
    }
    Ok(())
}

/// Launches `prefix` (`gemm_` or `gemm_swiglu_`) for `w`'s `stacks` stacks over `x` into `y`
/// (rows `y_ld` elements apart; the caller checked every shape against the rows it passes).
#[allow(clippy::too_many_arguments)]
pub(crate) fn launch_stacks(
    dev: &Device,
    prefix: &str,
    x: &DeviceTensor<bf16>,
    x_ld: usize,
    w: &Stack,
    stacks: usize,
    rows: Rows<'_>,
    limit: f32,
    y: Output,
    y_ld: usize,
) -> Result<(), GpuError> {
    let tiles = w.tiles();
    let (m, lists, counts, stride, div, block_rows, blocks, x_col, y_col, tensor) = match rows {
        Rows::Grouped { m } => (m, 0, 0, 0, 1, ROWS, m.div_ceil(ROWS), w.k, w.n, false),
        Rows::Lists {
            lists,
            counts,
            div,
            per_stack,
            tensor,
        } => {
            // The `_m16`, `_m32` and `_tc` kernels exist for the FP4 formats (32-element
            // chunks), the experts'.
            let fp4 = w.format.chunk_elems() == 32;
            let block_rows = if tensor {
                TC_ROWS
            } else if !fp4 || per_stack > SHORT_LISTS {
                ROWS
            } else if per_stack > FEW_LISTS {
                SHORT_ROWS
            } else {
                FEW_ROWS
            };
            (
                0,
                lists.device_address(),
                counts.device_address(),
                lists.len() / stacks.max(1),
                div,
                block_rows,
                per_stack.div_ceil(block_rows).max(1),
                0,
                0,
                tensor,
            )
        }
    };
    if tensor {
        check_tensor_lists(dev.arch(), w)?;
    }
    let (kernel, shared) = match block_rows {
        TC_ROWS => (format!("{prefix}{}_tc", w.format.name()), TC_SHARED),
        ROWS => (
            format!("{prefix}{}", w.format.name()),
            shared_bytes(ROWS, &w.format),
        ),
        _ => (
            format!("{prefix}{}_m{block_rows}", w.format.name()),
            shared_bytes(block_rows, &w.format),
        ),
    };
    check_shared(dev, &kernel, shared)?;
    let args = GemmArgs {
        x: x.device_address(),
        w: w.codes,
        s: w.scales,
        fs0: w.fp8.0,
        fs1: w.fp8.1,
        y: y.address,
        rows: lists,
        counts,
        g0: w.factors.0,
        g1: w.factors.1,
        m: dim_u32("gemm rows", m)?,
        n: dim_u32("gemm n", w.n)?,
        k: dim_u32("gemm k", w.k)?,
        post0: w.post.0,
        post1: w.post.1,
        limit,
        fp8_br: match w.format {
            GemvFormat::Fp8 { block, .. } => block.0 as u32,
            _ => 1,
        },
        tiles: dim_u32("gemm tiles", tiles)?,
        y_f32: y.mode,
        x_ld: dim_u32("gemm x row", x_ld)?,
        y_ld: dim_u32("gemm y row", y_ld)?,
        x_col_z: dim_u32("gemm x columns", x_col)?,
        y_col_z: dim_u32("gemm y columns", y_col)?,
        list_stride: dim_u32("gemm list", stride)?,
        row_div: dim_u32("gemm row divisor", div)?,
        y_perm: (tensor && w.gate_up) as u32,
    };
    let grid = (
        dim_u32("gemm row blocks", blocks.max(1))?,
        dim_u32("gemm tile blocks", tiles.div_ceil(WARPS))?,
        dim_u32("gemm stacks", stacks)?,
    );
    // SAFETY: GemmArgs mirrors the kernel's argument; the weight's tensors hold `stacks *
    // tiles` whole packed tiles; x and y hold the rows and columns the caller checked (list
    // entries below its bound).
    unsafe {
        launch_struct(
            dev,
            &kernel,
            grid,
            ((WARPS * 32) as u32, shared as u32),
            &args,
            super::gemv::tuning::PROGRAMMATIC_LAUNCH.get(),
            1,
        )
    }
}

/// Launches `prefix` (`gemm_` or `gemm_swiglu_`) for `m > MAX_M` rows of `x [m, groups·K]`
/// into `y`: `groups` blocks of the weight's rows, group `g` reading x's columns
/// `[g·K, (g+1)·K)` (the caller checked every shape). FP8 weights with scale blocks of a
/// multiple of 128 columns, whose rows' split codes fit the workspace, take [`launch_fp8_tc`]
/// on sm_90a (unless [`super::gemv::tuning::FP8_TENSOR_GEMM`] is off).
#[allow(clippy::too_many_arguments)]
pub(crate) fn launch(
    dev: &Device,
    prefix: &str,
    x: &DeviceTensor<bf16>,
    m: usize,
    w: &GemvWeight,
    limit: f32,
    y: Output,
    groups: usize,
    ws: &mut GemvWorkspace,
) -> Result<(), GpuError> {
    debug_assert!(m > MAX_M);
    if let GemvFormat::Fp8 { block, .. } = w.format {
        // Its steps are 128 columns of one scale block, and at least one row's split codes
        // must fit the workspace.
        let whole_steps = block.1.is_multiple_of(FP8_TC_STEP);
        let pass = fp8_tc_pass(ws, w.k, groups);
        if whole_steps
            && pass > 0
            && dev.arch() == Arch::Sm90a
            && super::gemv::tuning::FP8_TENSOR_GEMM.get()
        {
            let swiglu = prefix == "gemm_swiglu_";
            return launch_fp8_tc(dev, swiglu, x, m, w, block, limit, y, groups, ws, pass);
        }
    }
    let stack = Stack {
        format: w.format,
        n: w.n / groups,
        k: w.k,
        gate_up: w.gate_up,
        codes: w.codes.device_address(),
        scales: w.scales.as_ref().map_or(0, |s| s.device_address()),
        fp8: w.fp8_scale_addresses(),
        post: w.post,
        factors: (0, 0),
    };
    let rows = Rows::Grouped { m };
    launch_stacks(
        dev,
        prefix,
        x,
        groups * w.k,
        &stack,
        groups,
        rows,
        limit,
        y,
        w.n,
    )
}

/// Arguments of `act_split_e4m3` (mirrors `ActSplitArgs` in gemm_fp8.cu).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct ActSplitArgs {
    x: u64,
    codes: u64,
    scales: u64,
    k: u32,
    kp: u32,
    groups: u32,
    x_ld: u32,
    codes_ld: u32,
}

/// Arguments of `gemm_fp8_tc` (mirrors `GemmFp8Args` in gemm_fp8.cu).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct GemmFp8Args {
    codes: u64,
    scales: u64,
    w: u64,
    fs0: u64,
    fs1: u64,
    y: u64,
    m: u32,
    n: u32,
    k: u32,
    kp: u32,
    post0: f32,
    post1: f32,
    limit: f32,
    fp8_br: u32,
    tiles: u32,
    y_f32: u32,
    y_ld: u32,
    codes_ld: u32,
}

// SAFETY: plain old data with the CUDA structs' layouts (checked by a test).
unsafe impl DeviceRepr for ActSplitArgs {}
unsafe impl DeviceRepr for GemmFp8Args {}

/// `gemm_fp8_tc`'s block: weight rows by activation rows, its K step, and the steps its shared
/// memory holds (`ROWS`, `TOKENS`, `STEP`, `STAGES` in gemm_fp8.cu).
const FP8_TC_ROWS: usize = 128;
const FP8_TC_TOKENS: usize = 128;
const FP8_TC_STEP: usize = 128;
const FP8_TC_STAGES: usize = 4;

/// Rows of x whose split codes (`groups` groups of `k` columns, each padded to whole steps) and
/// scales the workspace holds at once: a pass of [`launch_fp8_tc`].
fn fp8_tc_pass(ws: &GemvWorkspace, k: usize, groups: usize) -> usize {
    let codes_ld = 2 * groups * k.div_ceil(FP8_TC_STEP) * FP8_TC_STEP;
    (ws.act_codes.len() / codes_ld).min(ws.act_scales.len() / groups)
}

/// The FP8 prefill GEMM on both operands in e4m3 (`kernels/gemm_fp8.cu`): `act_split_e4m3`
/// splits x's rows into the workspace, `gemm_fp8_tc` (or `gemm_swiglu_fp8_tc`) multiplies, in
/// passes of `pass` rows ([`fp8_tc_pass`]; rows are independent, so passes give the same bits
/// as one launch).
#[allow(clippy::too_many_arguments)]
fn launch_fp8_tc(
    dev: &Device,
    swiglu: bool,
    x: &DeviceTensor<bf16>,
    m: usize,
    w: &GemvWeight,
    block: (usize, usize),
    limit: f32,
    y: Output,
    groups: usize,
    ws: &mut GemvWorkspace,
    pass: usize,
) -> Result<(), GpuError> {
    let n = w.n / groups;
    let k = w.k;
    let kp = k.div_ceil(FP8_TC_STEP) * FP8_TC_STEP;
    let codes_ld = 2 * groups * kp;
    let x_ld = groups * k;
    let tiles = pack::Layout {
        rows: n,
        chunks: k / w.format.chunk_elems(),
        gate_up: w.gate_up,
    }
    .tiles();
    let (fs0, fs1) = w.fp8_scale_addresses();
    let y_ld = w.n;
    let y_elem = if y.mode == 0 { 2 } else { 4 };
    let kernel = if swiglu {
        "gemm_swiglu_fp8_tc"
    } else {
        "gemm_fp8_tc"
    };
    // 1 KB more: the kernel aligns its stages to the swizzle's 1 KB atoms.
    let shared = FP8_TC_STAGES * FP8_TC_STEP * (FP8_TC_ROWS + 2 * FP8_TC_TOKENS) + 1024;
    check_shared(dev, kernel, shared)?;
    let pdl = super::gemv::tuning::PROGRAMMATIC_LAUNCH.get();
    for r0 in (0..m).step_by(pass) {
        let rows = pass.min(m - r0);
        let rows_u32 = dim_u32("gemm rows", rows)?;
        let split = ActSplitArgs {
            x: x.device_address() + (r0 * x_ld * 2) as u64,
            codes: ws.act_codes.device_address(),
            scales: ws.act_scales.device_address(),
            k: dim_u32("gemm k", k)?,
            kp: dim_u32("gemm k", kp)?,
            groups: dim_u32("gemm groups", groups)?,
            x_ld: dim_u32("gemm x row", x_ld)?,
            codes_ld: dim_u32("gemm split row", codes_ld)?,
        };
        // SAFETY: ActSplitArgs mirrors the kernel's argument; x holds `m` rows of x_ld; the
        // workspace `rows` rows of codes_ld bytes and `rows * groups` scales (`pass`).
        unsafe {
            launch_struct(
                dev,
                "act_split_e4m3",
                (rows_u32, dim_u32("gemm groups", groups)?, 1),
                (256, 0),
                &split,
                pdl,
                1,
            )?;
        }
        let args = GemmFp8Args {
            codes: split.codes,
            scales: split.scales,
            w: w.codes.device_address(),
            fs0,
            fs1,
            y: y.address + (r0 * y_ld * y_elem) as u64,
            m: rows_u32,
            n: dim_u32("gemm n", n)?,
            k: split.k,
            kp: split.kp,
            post0: w.post.0,
            post1: w.post.1,
            limit,
            fp8_br: dim_u32("gemm scale rows", block.0)?,
            tiles: dim_u32("gemm tiles", tiles)?,
            y_f32: y.mode,
            y_ld: dim_u32("gemm y row", y_ld)?,
            codes_ld: split.codes_ld,
        };
        let grid = (
            dim_u32("gemm row blocks", rows.div_ceil(FP8_TC_TOKENS))?,
            dim_u32("gemm tile blocks", (tiles * 16).div_ceil(FP8_TC_ROWS))?,
            dim_u32("gemm groups", groups)?,
        );
        // SAFETY: GemmFp8Args mirrors the kernel's argument; the weight holds `groups * tiles`
        // packed tiles and its FP8 scale rows; the codes and scales of `rows` rows were just
        // written; y holds `m` rows of y_ld.
        unsafe {
            launch_struct(dev, kernel, grid, (256, shared as u32), &args, pdl, 1)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn args_layout_matches_the_cuda_struct() {
        // 10 pointers, 3 u32, 3 f32, 10 u32 = 144 bytes.
        assert_eq!(std::mem::size_of::<GemmArgs>(), 144);
        assert_eq!(std::mem::offset_of!(GemmArgs, y_perm), 140);
        assert_eq!(std::mem::align_of::<GemmArgs>(), 8);
        // 3 pointers, 5 u32 = 44 bytes, padded to 48; 6 pointers, 4 u32, 3 f32, 5 u32 = 96.
        assert_eq!(std::mem::size_of::<ActSplitArgs>(), 48);
        assert_eq!(std::mem::size_of::<GemmFp8Args>(), 96);
    }

    #[test]
    fn tensor_lists_refuse_other_gpus_formats_and_shapes_by_name() {
        let stack = |format, n, k, gate_up| Stack {
            format,
            n,
            k,
            gate_up,
            codes: 0,
            scales: 0,
            fp8: (0, 0),
            post: (1.0, 1.0),
            factors: (0, 0),
        };
        let ok = stack(GemvFormat::Nvfp4, 2048, 4096, true);
        assert!(check_tensor_lists(Arch::Sm90a, &ok).is_ok());
        assert!(
            check_tensor_lists(Arch::Sm90a, &stack(GemvFormat::Mxfp4, 4096, 2048, false)).is_ok()
        );
        // Plain launches may have N off 128 (their tiles past N store nothing).
        assert!(
            check_tensor_lists(Arch::Sm90a, &stack(GemvFormat::Nvfp4, 200, 256, false)).is_ok()
        );
        let refused = |arch, w: &Stack, what: &str| {
            let err = check_tensor_lists(arch, w).unwrap_err().to_string();
            assert!(err.contains("tensor-core expert kernels"), "{err}");
            assert!(err.contains(what), "{err} lacks {what}");
        };
        refused(Arch::Sm100a, &ok, "need sm_90a, not Sm100a");
        refused(
            Arch::Sm90a,
            &stack(GemvFormat::Bf16, 2048, 4096, true),
            "FP4 weights, not Bf16",
        );
        refused(
            Arch::Sm90a,
            &stack(GemvFormat::Nvfp4, 2048, 4000, true),
            "K = 4000",
        );
        refused(
            Arch::Sm90a,
            &stack(GemvFormat::Nvfp4, 2000, 4096, true),
            "N = 2000",
        );
    }
}
