//! Loading every family onto a device, and ahead-of-time compilation into the cache.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream};
use cudarc::nvrtc::Ptx;

use crate::cache::{CacheKey, CacheLookup, KernelCache, KeyInputs};
use crate::compile::{compile_family, compile_family_as, nvrtc_version, Build};
use crate::{Arch, ImageKind, KernelError, KernelFamily, FAMILIES, HEADERS};

/// Where a family's image came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ImageSource {
    Cache,
    Compiled,
    /// The cache held an unusable entry (the reason), which was recompiled and replaced.
    Rebuilt(String),
}

/// How one family was loaded.
#[derive(Debug, Clone)]
pub struct FamilyLoad {
    pub family: &'static str,
    pub source: ImageSource,
    /// Cache lookup (read and verify) time.
    pub lookup: Duration,
    /// NVRTC time; zero on a cache hit.
    pub compile: Duration,
    /// `cuModuleLoadData` plus function lookups.
    pub module_load: Duration,
    pub image_bytes: usize,
    /// NVRTC warnings, if the image was compiled now.
    pub log: String,
    /// Set when the compiled image could not be written to the cache (loading still succeeds).
    pub cache_error: Option<String>,
}

/// All kernels, loaded onto one context.
#[derive(Debug)]
pub struct Kernels {
    arch: Arch,
    nvrtc_version: (i32, i32),
    functions: HashMap<&'static str, CudaFunction>,
    loads: Vec<FamilyLoad>,
    // Functions borrow their module's handle; keep the modules alive with them.
    modules: Vec<Arc<CudaModule>>,
}

fn key_for(family: &KernelFamily, arch: Arch, build: Build, nvrtc_version: (i32, i32)) -> CacheKey {
    CacheKey::compute(&KeyInputs {
        family: family.name,
        source: &build.source(family),
        headers: HEADERS,
        options: &build.options(arch),
        arch,
        nvrtc_version,
    })
}

/// The image for `family`, from the cache or freshly compiled (and then stored).
fn obtain(
    family: &'static KernelFamily,
    arch: Arch,
    build: Build,
    nvrtc: (i32, i32),
    cache: &KernelCache,
) -> Result<(Vec<u8>, FamilyLoad), KernelError> {
    let key = key_for(family, arch, build, nvrtc);
    let t = Instant::now();
    let lookup = cache.lookup(&key)?;
    let lookup_time = t.elapsed();
    let mut load = FamilyLoad {
        family: family.name,
        source: ImageSource::Cache,
        lookup: lookup_time,
        compile: Duration::ZERO,
        module_load: Duration::ZERO,
        image_bytes: 0,
        log: String::new(),
        cache_error: None,
    };
    let image = match lookup {
        CacheLookup::Hit { kind, image } if kind == arch.image_kind() => image,
        other => {
            load.source = match other {
                CacheLookup::Invalid(e) => ImageSource::Rebuilt(e.to_string()),
                CacheLookup::Hit { .. } => ImageSource::Rebuilt("wrong image kind".to_string()),
                CacheLookup::Miss => ImageSource::Compiled,
            };
            let t = Instant::now();
            let compiled = compile_family_as(family, arch, build)?;
            load.compile = t.elapsed();
            load.log = compiled.log;
            if let Err(e) = cache.store(&key, compiled.kind, &compiled.image) {
                load.cache_error = Some(e.to_string());
            }
            compiled.image
        }
    };
    load.image_bytes = image.len();
    Ok((image, load))
}

impl Kernels {
    /// Loads every family for the context's device, using the default cache
    /// ([`KernelCache::from_env`]).
    pub fn load(ctx: &Arc<CudaContext>) -> Result<Kernels, KernelError> {
        Kernels::load_with(ctx, &KernelCache::from_env()?)
    }

    pub fn load_with(ctx: &Arc<CudaContext>, cache: &KernelCache) -> Result<Kernels, KernelError> {
        Kernels::load_as(ctx, cache, Build::Plain)
    }

    /// [`Kernels::load_with`] for a build.
    pub fn load_as(
        ctx: &Arc<CudaContext>,
        cache: &KernelCache,
        build: Build,
    ) -> Result<Kernels, KernelError> {
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| KernelError::driver("querying the compute capability", e))?;
        let arch = Arch::for_compute_capability(major as u32, minor as u32);
        let nvrtc = nvrtc_version()?;
        let mut functions = HashMap::new();
        let mut modules = Vec::with_capacity(FAMILIES.len());
        let mut loads = Vec::with_capacity(FAMILIES.len());
        for family in FAMILIES {
            let (image, mut load) = obtain(family, arch, build, nvrtc, cache)?;
            let t = Instant::now();
            let ptx = match arch.image_kind() {
                ImageKind::Cubin => Ptx::from_binary(image),
                ImageKind::Ptx => Ptx::from_src(String::from_utf8_lossy(&image).into_owned()),
            };
            let module = ctx.load_module(ptx).map_err(|e| {
                KernelError::driver(format!("loading module `{}` ({arch})", family.name), e)
            })?;
            for &name in family.functions {
                let f = module
                    .load_function(name)
                    .map_err(|e| KernelError::driver(format!("looking up kernel `{name}`"), e))?;
                functions.insert(name, f);
            }
            load.module_load = t.elapsed();
            modules.push(module);
            loads.push(load);
        }
        Ok(Kernels {
            arch,
            nvrtc_version: nvrtc,
            functions,
            loads,
            modules,
        })
    }

    pub fn function(&self, name: &str) -> Result<&CudaFunction, KernelError> {
        self.functions
            .get(name)
            .ok_or_else(|| KernelError::UnknownFunction(name.to_string()))
    }

    pub fn arch(&self) -> Arch {
        self.arch
    }

    pub fn nvrtc_version(&self) -> (i32, i32) {
        self.nvrtc_version
    }

    pub fn loads(&self) -> &[FamilyLoad] {
        &self.loads
    }

    /// Points every module of a timeline build at its log: `log` (device address) holding
    /// `per_sm` records for each SM (`DSV4_TIMELINE` in dsv4_common.cuh).
    pub fn set_timeline_log(
        &self,
        stream: &Arc<CudaStream>,
        log: u64,
        per_sm: u32,
    ) -> Result<(), KernelError> {
        let err = |e| KernelError::driver("setting the timeline log", e);
        let (log, per_sm) = (log.to_ne_bytes(), per_sm.to_ne_bytes());
        for module in &self.modules {
            for (name, value) in [
                ("dsv4_timeline_log", &log[..]),
                ("dsv4_timeline_per_sm", &per_sm[..]),
            ] {
                let mut at = module.get_global(name, stream).map_err(err)?;
                stream.memcpy_htod(value, &mut at).map_err(err)?;
            }
        }
        stream.synchronize().map_err(err)
    }
}

/// Cold and warm cost of one family in [`precompile`].
#[derive(Debug, Clone)]
pub struct FamilyTiming {
    pub family: &'static str,
    /// NVRTC compile plus cache store.
    pub cold: Duration,
    /// Cache lookup (read and verify) of the entry just stored.
    pub warm: Duration,
    pub image_bytes: usize,
    pub log: String,
}

#[derive(Debug, Clone)]
pub struct PrecompileReport {
    pub arch: Arch,
    pub nvrtc_version: (i32, i32),
    pub cache_dir: std::path::PathBuf,
    pub families: Vec<FamilyTiming>,
}

/// Compiles every family for `arch` into `cache` (replacing what is there), then reads each
/// entry back, timing both. Needs NVRTC but no GPU (`dsv4 kernels --precompile`).
pub fn precompile(arch: Arch, cache: &KernelCache) -> Result<PrecompileReport, KernelError> {
    let nvrtc = nvrtc_version()?;
    let mut families = Vec::with_capacity(FAMILIES.len());
    for family in FAMILIES {
        let key = key_for(family, arch, Build::Plain, nvrtc);
        let t = Instant::now();
        let compiled = compile_family(family, arch)?;
        cache.store(&key, compiled.kind, &compiled.image)?;
        let cold = t.elapsed();
        let t = Instant::now();
        let lookup = cache.lookup(&key)?;
        let warm = t.elapsed();
        match lookup {
            CacheLookup::Hit { image, .. } if image == compiled.image => {}
            other => {
                return Err(KernelError::CacheReadBack {
                    family: family.name.to_string(),
                    reason: match other {
                        CacheLookup::Invalid(e) => e.to_string(),
                        CacheLookup::Miss => "missing".to_string(),
                        CacheLookup::Hit { .. } => "different bytes".to_string(),
                    },
                })
            }
        }
        families.push(FamilyTiming {
            family: family.name,
            cold,
            warm,
            image_bytes: compiled.image.len(),
            log: compiled.log,
        });
    }
    Ok(PrecompileReport {
        arch,
        nvrtc_version: nvrtc,
        cache_dir: cache.dir().to_path_buf(),
        families,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nvrtc_available;

    #[test]
    #[ignore = "needs NVRTC on the loader path; cargo xtask check-kernels runs it"]
    fn nvrtc_precompile_fills_the_cache() {
        assert!(nvrtc_available(), "NVRTC is not on the loader path");
        let dir = tempfile::tempdir().unwrap();
        let cache = KernelCache::new(dir.path());
        let report = precompile(Arch::Sm90a, &cache).unwrap();
        assert_eq!(report.families.len(), FAMILIES.len());
        for (f, t) in FAMILIES.iter().zip(&report.families) {
            let key = key_for(f, Arch::Sm90a, Build::Plain, report.nvrtc_version);
            assert!(matches!(
                cache.lookup(&key).unwrap(),
                CacheLookup::Hit {
                    kind: ImageKind::Cubin,
                    ..
                }
            ));
            assert!(
                t.warm < t.cold,
                "reading the cache should beat compiling: {t:?}"
            );
        }
    }

    /// Cold (empty cache) against warm (filled cache) load on a real device.
    #[test]
    #[ignore = "needs a CUDA GPU: cargo xtask gpu-test"]
    fn gpu_load_cold_then_warm() {
        assert!(
            crate::driver_available(),
            "no CUDA driver library on this machine: GPU test cannot run"
        );
        let ctx = CudaContext::new(0).expect("a CUDA device");
        let dir = tempfile::tempdir().unwrap();
        let cache = KernelCache::new(dir.path());
        let t = Instant::now();
        let cold = Kernels::load_with(&ctx, &cache).unwrap();
        let cold_total = t.elapsed();
        let t = Instant::now();
        let warm = Kernels::load_with(&ctx, &cache).unwrap();
        let warm_total = t.elapsed();
        for (c, w) in cold.loads().iter().zip(warm.loads()) {
            assert_eq!(c.source, ImageSource::Compiled);
            assert_eq!(w.source, ImageSource::Cache);
            assert!(
                c.log.is_empty(),
                "NVRTC warnings for {}: {}",
                c.family,
                c.log
            );
            println!(
                "kernel family {:<10} {} cold: compile {:?} + module {:?} | warm: lookup {:?} + module {:?} ({} bytes)",
                c.family, cold.arch(), c.compile, c.module_load, w.lookup, w.module_load, w.image_bytes
            );
        }
        println!("Kernels::load total: cold {cold_total:?}, warm {warm_total:?}");
        assert!(warm_total < cold_total);
        for f in FAMILIES {
            for name in f.functions {
                warm.function(name).unwrap();
            }
        }
        assert!(matches!(
            warm.function("no_such_kernel"),
            Err(KernelError::UnknownFunction(_))
        ));

        // A corrupted entry is detected and rebuilt.
        let key = key_for(
            &FAMILIES[0],
            cold.arch(),
            Build::Plain,
            cold.nvrtc_version(),
        );
        let path = cache.path_for(&key);
        let mut bytes = std::fs::read(&path).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 0xff;
        std::fs::write(&path, bytes).unwrap();
        let again = Kernels::load_with(&ctx, &cache).unwrap();
        assert!(matches!(again.loads()[0].source, ImageSource::Rebuilt(_)));
    }
}
