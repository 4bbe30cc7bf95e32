//! The embedded CUDA sources.

/// A header that kernel sources may `#include "<name>"`. NVRTC receives its contents, not a
/// path, so compilation does not depend on the working directory.
#[derive(Debug, Clone, Copy)]
pub struct Header {
    pub name: &'static str,
    pub contents: &'static str,
}

/// One `.cu` file: compiled as one NVRTC program and loaded as one module.
#[derive(Debug, Clone, Copy)]
pub struct KernelFamily {
    pub name: &'static str,
    pub file: &'static str,
    pub source: &'static str,
    /// Entry points declared with `DSV4_KERNEL` (extern "C", so names are unmangled).
    pub functions: &'static [&'static str],
}

pub const HEADERS: &[Header] = &[
    Header {
        name: "dsv4_common.cuh",
        contents: include_str!("../kernels/dsv4_common.cuh"),
    },
    Header {
        name: "gemv_tile.cu",
        contents: include_str!("../kernels/gemv_tile.cu"),
    },
];

pub const FAMILIES: &[KernelFamily] = &[
    KernelFamily {
        name: "formats",
        file: "formats.cu",
        source: include_str!("../kernels/formats.cu"),
        functions: &[
            "nvfp4_act_amax",
            "nvfp4_act_quantize",
            "nvfp4_dequant",
            "mxfp4_dequant",
            "fp8_block_dequant_e8m0",
            "fp8_block_dequant_f32",
            "scale_swizzle_32_4_4",
            "scale_unswizzle_32_4_4",
            "kv_fp8_quantize",
            "kv_fp8_dequant",
        ],
    },
    KernelFamily {
        name: "gemv",
        file: "gemv.cu",
        source: include_str!("../kernels/gemv.cu"),
        functions: &[
            "gemv_bf16_m8",
            "gemv_bf16_m16",
            "gemv_fp8_m8",
            "gemv_fp8_m16",
            "gemv_nvfp4_m8",
            "gemv_nvfp4_m16",
            "gemv_mxfp4_m8",
            "gemv_mxfp4_m16",
            "gemv_swiglu_bf16_m8",
            "gemv_swiglu_bf16_m16",
            "gemv_swiglu_fp8_m8",
            "gemv_swiglu_fp8_m16",
            "gemv_fp8_m1",
            "gemv_swiglu_fp8_m1",
            "gemv_swiglu_nvfp4_m8",
            "gemv_swiglu_nvfp4_m16",
            "gemv_swiglu_mxfp4_m8",
            "gemv_swiglu_mxfp4_m16",
        ],
    },
    KernelFamily {
        name: "gemm",
        file: "gemm.cu",
        source: include_str!("../kernels/gemm.cu"),
        functions: &[
            "gemm_bf16",
            "gemm_fp8",
            "gemm_nvfp4",
            "gemm_mxfp4",
            "gemm_swiglu_bf16",
            "gemm_swiglu_fp8",
            "gemm_swiglu_nvfp4",
            "gemm_swiglu_mxfp4",
            "gemm_nvfp4_m32",
            "gemm_mxfp4_m32",
            "gemm_swiglu_nvfp4_m32",
            "gemm_swiglu_mxfp4_m32",
            "gemm_nvfp4_m16",
            "gemm_mxfp4_m16",
            "gemm_swiglu_nvfp4_m16",
            "gemm_swiglu_mxfp4_m16",
            "gemm_nvfp4_tc",
            "gemm_mxfp4_tc",
            "gemm_swiglu_nvfp4_tc",
            "gemm_swiglu_mxfp4_tc",
            "fp4_k_permute",
        ],
    },
    KernelFamily {
        name: "gemm_fp8",
        file: "gemm_fp8.cu",
        source: include_str!("../kernels/gemm_fp8.cu"),
        functions: &["act_split_e4m3", "gemm_fp8_tc", "gemm_swiglu_fp8_tc"],
    },
    KernelFamily {
        name: "moe",
        file: "moe.cu",
        source: include_str!("../kernels/moe.cu"),
        functions: &[
            "moe_gate_up_nvfp4",
            "moe_gate_up_mxfp4",
            "moe_down_nvfp4",
            "moe_down_mxfp4",
            "moe_down_nvfp4_f32",
            "moe_down_mxfp4_f32",
            "moe_down_nvfp4_f32add",
            "moe_down_mxfp4_f32add",
            "moe_sort",
            "moe_combine",
        ],
    },
    KernelFamily {
        name: "moe_bf16",
        file: "moe_bf16.cu",
        source: include_str!("../kernels/moe_bf16.cu"),
        functions: &["moe_bf16_gate_up", "moe_bf16_down"],
    },
    KernelFamily {
        name: "rows",
        file: "rows.cu",
        source: include_str!("../kernels/rows.cu"),
        functions: &[
            "embed_hc_gather",
            "rms_norm_rows",
            "rms_norm_rows_w512",
            "rope_rows",
            "advance_position",
            "chunk_positions",
        ],
    },
    KernelFamily {
        name: "mhc",
        file: "mhc.cu",
        source: include_str!("../kernels/mhc.cu"),
        functions: &[
            "hc_mix_partials",
            "hc_mix_partials_t16",
            "hc_post_mix",
            "hc_post_mix_t16",
            "hc_pre",
            "hc_head",
            "hc_comb",
        ],
    },
    KernelFamily {
        name: "router",
        file: "router.cu",
        source: include_str!("../kernels/router.cu"),
        functions: &[
            "route_topk",
            "gate_logits_bf16",
            "gate_logits_f32",
            "gate_logits_rows_bf16",
            "gate_logits_rows_f32",
            "gate_route_bf16",
            "gate_route_f32",
        ],
    },
    KernelFamily {
        name: "attention",
        file: "attention.cu",
        source: include_str!("../kernels/attention.cu"),
        functions: &[
            "compressor_emit",
            "compressor_store",
            "index_scores",
            "index_select",
            "attention_heads",
            "attention_mma",
            "attention_merge",
            "index_scores_mma",
            "window_write",
        ],
    },
    KernelFamily {
        name: "sample",
        file: "sample.cu",
        source: include_str!("../kernels/sample.cu"),
        functions: &["sample_prepare", "sample_pick"],
    },
    KernelFamily {
        name: "collective",
        file: "collective.cu",
        source: include_str!("../kernels/collective.cu"),
        functions: &["all_reduce_oneshot", "all_gather_cols"],
    },
    KernelFamily {
        name: "relayout",
        file: "relayout.cu",
        source: include_str!("../kernels/relayout.cu"),
        functions: &["pack_tiles", "fp8_scale_rows"],
    },
    KernelFamily {
        name: "random",
        file: "random.cu",
        source: include_str!("../kernels/random.cu"),
        functions: &["random_bytes", "random_bf16", "random_f16", "random_f32"],
    },
];

pub fn family(name: &str) -> Option<&'static KernelFamily> {
    FAMILIES.iter().find(|f| f.name == name)
}

/// Names declared as `DSV4_KERNEL void [__launch_bounds__(..)] <name>(` in a source.
#[cfg(test)]
pub(crate) fn declared_kernels(source: &str) -> Vec<&str> {
    source
        .split("DSV4_KERNEL void ")
        .skip(1)
        .map(|rest| match rest.strip_prefix("__launch_bounds__(") {
            Some(b) => b.split_once(')').map_or(b, |(_, r)| r),
            None => rest,
        })
        .filter_map(|rest| rest.split('(').next())
        .map(str::trim)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn function_lists_match_the_sources() {
        for f in FAMILIES {
            let declared: Vec<&str> = declared_kernels(f.source);
            let listed: Vec<&str> = f.functions.to_vec();
            let mut d = declared.clone();
            let mut l = listed.clone();
            d.sort_unstable();
            l.sort_unstable();
            assert_eq!(
                d, l,
                "family {} declares {:?} but lists {:?}",
                f.name, declared, listed
            );
        }
    }

    #[test]
    fn names_are_unique_across_families() {
        let mut seen = HashSet::new();
        for f in FAMILIES {
            assert!(
                f.file.ends_with(".cu") && f.file.starts_with(f.name),
                "{}",
                f.file
            );
            for name in f.functions {
                assert!(seen.insert(*name), "kernel {name} defined twice");
            }
        }
    }

    #[test]
    fn includes_resolve_to_embedded_headers() {
        let known: HashSet<&str> = HEADERS.iter().map(|h| h.name).collect();
        let sources = FAMILIES
            .iter()
            .map(|f| f.source)
            .chain(HEADERS.iter().map(|h| h.contents));
        for src in sources {
            for line in src
                .lines()
                .filter(|l| l.trim_start().starts_with("#include"))
            {
                let name = line
                    .split('"')
                    .nth(1)
                    .unwrap_or_else(|| panic!("only quoted includes: {line}"));
                assert!(known.contains(name), "{name} is not an embedded header");
            }
        }
    }
}
