//! On-disk cache of compiled kernel images.
//!
//! One file per entry, named by the hex [`CacheKey`]. A file is written under a unique
//! temporary name and renamed into place, so readers never see a half-written entry and
//! concurrent writers of the same key (which write identical bytes) simply replace each other.
//! Every entry carries a header (magic, format version, image kind, its own key, payload length
//! and SHA-256), so a truncated, corrupted or misplaced file is detected and rebuilt.

use std::fs;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use sha2::{Digest, Sha256};

use crate::{Arch, Header, ImageKind, KernelError};

const MAGIC: [u8; 8] = *b"DSV4KIMG";
const FORMAT_VERSION: u32 = 1;
/// magic + version + kind + key + payload length + payload SHA-256.
const HEADER_LEN: usize = 8 + 4 + 4 + 32 + 8 + 32;

/// Everything that determines the compiled image.
#[derive(Debug, Clone)]
pub struct KeyInputs<'a> {
    pub family: &'a str,
    pub source: &'a str,
    pub headers: &'a [Header],
    pub options: &'a [String],
    pub arch: Arch,
    pub nvrtc_version: (i32, i32),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CacheKey([u8; 32]);

impl CacheKey {
    pub fn compute(inputs: &KeyInputs<'_>) -> CacheKey {
        let mut h = Sha256::new();
        // Length-prefix every field so that moving bytes between fields changes the key.
        let mut field = |bytes: &[u8]| {
            h.update((bytes.len() as u64).to_le_bytes());
            h.update(bytes);
        };
        field(b"dsv4-kernels image v1");
        field(inputs.family.as_bytes());
        field(inputs.source.as_bytes());
        field(&(inputs.headers.len() as u64).to_le_bytes());
        for header in inputs.headers {
            field(header.name.as_bytes());
            field(header.contents.as_bytes());
        }
        field(&(inputs.options.len() as u64).to_le_bytes());
        for opt in inputs.options {
            field(opt.as_bytes());
        }
        field(inputs.arch.nvrtc_target().as_bytes());
        field(&inputs.nvrtc_version.0.to_le_bytes());
        field(&inputs.nvrtc_version.1.to_le_bytes());
        CacheKey(h.finalize().into())
    }

    pub fn bytes(&self) -> &[u8; 32] {
        &self.0
    }

    pub fn hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }
}

/// Why an entry was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EntryError {
    #[error("entry is {0} bytes, shorter than its header")]
    Truncated(usize),
    #[error("bad magic")]
    BadMagic,
    #[error("format version {0}, expected {FORMAT_VERSION}")]
    Version(u32),
    #[error("unknown image kind {0}")]
    Kind(u32),
    #[error("entry belongs to another key")]
    KeyMismatch,
    #[error("payload is {found} bytes, header says {expected}")]
    Length { expected: u64, found: u64 },
    #[error("payload checksum mismatch")]
    Checksum,
}

fn kind_code(kind: ImageKind) -> u32 {
    match kind {
        ImageKind::Cubin => 1,
        ImageKind::Ptx => 2,
    }
}

/// Serializes an entry: header followed by the payload.
pub fn encode_entry(key: &CacheKey, kind: ImageKind, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_LEN + payload.len());
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&kind_code(kind).to_le_bytes());
    out.extend_from_slice(&key.0);
    out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    out.extend_from_slice(&Sha256::digest(payload));
    out.extend_from_slice(payload);
    out
}

/// Validates an entry read for `key` and returns its kind and payload.
pub fn decode_entry<'a>(
    key: &CacheKey,
    bytes: &'a [u8],
) -> Result<(ImageKind, &'a [u8]), EntryError> {
    if bytes.len() < HEADER_LEN {
        return Err(EntryError::Truncated(bytes.len()));
    }
    let (header, payload) = bytes.split_at(HEADER_LEN);
    let u32_at = |o: usize| u32::from_le_bytes(header[o..o + 4].try_into().expect("4 bytes"));
    if header[..8] != MAGIC {
        return Err(EntryError::BadMagic);
    }
    let version = u32_at(8);
    if version != FORMAT_VERSION {
        return Err(EntryError::Version(version));
    }
    let kind = match u32_at(12) {
        1 => ImageKind::Cubin,
        2 => ImageKind::Ptx,
        k => return Err(EntryError::Kind(k)),
    };
    if header[16..48] != key.0 {
        return Err(EntryError::KeyMismatch);
    }
    let expected = u64::from_le_bytes(header[48..56].try_into().expect("8 bytes"));
    if expected != payload.len() as u64 {
        return Err(EntryError::Length {
            expected,
            found: payload.len() as u64,
        });
    }
    if Sha256::digest(payload)[..] != header[56..88] {
        return Err(EntryError::Checksum);
    }
    Ok((kind, payload))
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheLookup {
    Hit {
        kind: ImageKind,
        image: Vec<u8>,
    },
    Miss,
    /// A file exists but is unusable; it should be rebuilt.
    Invalid(EntryError),
}

/// A directory of compiled images.
#[derive(Debug, Clone)]
pub struct KernelCache {
    dir: PathBuf,
}

static TMP_COUNTER: AtomicU64 = AtomicU64::new(0);

impl KernelCache {
    pub fn new(dir: impl Into<PathBuf>) -> KernelCache {
        KernelCache { dir: dir.into() }
    }

    /// `$DSV4_KERNEL_CACHE`, else `<user cache dir>/dsv4/kernels`.
    pub fn from_env() -> Result<KernelCache, KernelError> {
        match std::env::var_os("DSV4_KERNEL_CACHE") {
            Some(dir) if !dir.is_empty() => Ok(KernelCache::new(dir)),
            _ => dirs::cache_dir()
                .map(|d| KernelCache::new(d.join("dsv4").join("kernels")))
                .ok_or(KernelError::NoCacheDir),
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn path_for(&self, key: &CacheKey) -> PathBuf {
        self.dir.join(format!("{}.img", key.hex()))
    }

    pub fn lookup(&self, key: &CacheKey) -> Result<CacheLookup, KernelError> {
        let path = self.path_for(key);
        let bytes = match fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(CacheLookup::Miss),
            Err(source) => return Err(KernelError::Cache { path, source }),
        };
        Ok(match decode_entry(key, &bytes) {
            Ok((kind, payload)) => CacheLookup::Hit {
                kind,
                image: payload.to_vec(),
            },
            Err(e) => CacheLookup::Invalid(e),
        })
    }

    /// Writes an entry atomically (unique temporary file, then rename over the final name).
    pub fn store(&self, key: &CacheKey, kind: ImageKind, image: &[u8]) -> Result<(), KernelError> {
        let err = |path: &Path| {
            let path = path.to_path_buf();
            move |source| KernelError::Cache { path, source }
        };
        fs::create_dir_all(&self.dir).map_err(err(&self.dir))?;
        let tmp = self.dir.join(format!(
            ".{}.{}.{}.tmp",
            key.hex(),
            std::process::id(),
            TMP_COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        let write = || -> io::Result<()> {
            let mut f = fs::File::create(&tmp)?;
            f.write_all(&encode_entry(key, kind, image))?;
            f.flush()
        };
        let finish = write().and_then(|()| fs::rename(&tmp, self.path_for(key)));
        if let Err(e) = finish {
            // Best effort: a leftover temporary file is never read as an entry.
            let _ = fs::remove_file(&tmp);
            return Err(err(&self.path_for(key))(e));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{FAMILIES, HEADERS};

    fn inputs<'a>(options: &'a [String], headers: &'a [Header]) -> KeyInputs<'a> {
        KeyInputs {
            family: "formats",
            source: FAMILIES[0].source,
            headers,
            options,
            arch: Arch::Sm90a,
            nvrtc_version: (13, 0),
        }
    }

    #[test]
    fn key_changes_when_any_input_changes() {
        let options = vec![
            "--std=c++17".to_string(),
            "--generate-line-info".to_string(),
        ];
        let base = CacheKey::compute(&inputs(&options, HEADERS));
        assert_eq!(
            base,
            CacheKey::compute(&inputs(&options, HEADERS)),
            "key must be deterministic"
        );

        let mut variants = Vec::new();
        let mut i = inputs(&options, HEADERS);
        i.family = "formats2";
        variants.push(("family", CacheKey::compute(&i)));
        let edited = format!("{} ", FAMILIES[0].source);
        let mut i = inputs(&options, HEADERS);
        i.source = &edited;
        variants.push(("source", CacheKey::compute(&i)));
        let edited_header = format!("{}\n// edit", HEADERS[0].contents);
        let headers = [Header {
            name: HEADERS[0].name,
            contents: &*edited_header.leak(),
        }];
        variants.push((
            "header contents",
            CacheKey::compute(&inputs(&options, &headers)),
        ));
        let renamed = [Header {
            name: "other.cuh",
            contents: HEADERS[0].contents,
        }];
        variants.push((
            "header name",
            CacheKey::compute(&inputs(&options, &renamed)),
        ));
        variants.push(("no headers", CacheKey::compute(&inputs(&options, &[]))));
        let more = vec![options[0].clone(), options[1].clone(), "-DX=1".to_string()];
        variants.push(("extra option", CacheKey::compute(&inputs(&more, HEADERS))));
        let reordered = vec![options[1].clone(), options[0].clone()];
        variants.push((
            "option order",
            CacheKey::compute(&inputs(&reordered, HEADERS)),
        ));
        // Moving a byte across the boundary between two options must not collide.
        let split = vec![
            "--std=c++1".to_string(),
            "7--generate-line-info".to_string(),
        ];
        variants.push((
            "option boundary",
            CacheKey::compute(&inputs(&split, HEADERS)),
        ));
        for arch in [Arch::Sm100a, Arch::Ptx { major: 9, minor: 0 }] {
            let mut i = inputs(&options, HEADERS);
            i.arch = arch;
            variants.push(("arch", CacheKey::compute(&i)));
        }
        for v in [(13, 1), (12, 0)] {
            let mut i = inputs(&options, HEADERS);
            i.nvrtc_version = v;
            variants.push(("nvrtc version", CacheKey::compute(&i)));
        }
        let mut all = vec![base];
        for (what, key) in &variants {
            assert!(
                !all.contains(key),
                "changing the {what} did not change the key"
            );
            all.push(*key);
        }
    }

    #[test]
    fn entry_round_trip() {
        let key = CacheKey([7; 32]);
        let payload: Vec<u8> = (0..1000u32).map(|i| (i * 31 % 251) as u8).collect();
        let bytes = encode_entry(&key, ImageKind::Cubin, &payload);
        assert_eq!(
            decode_entry(&key, &bytes),
            Ok((ImageKind::Cubin, &payload[..]))
        );
        let empty = encode_entry(&key, ImageKind::Ptx, &[]);
        assert_eq!(decode_entry(&key, &empty), Ok((ImageKind::Ptx, &[][..])));
    }

    #[test]
    fn damaged_entries_are_rejected() {
        let key = CacheKey([3; 32]);
        let payload = b"not really a cubin, but bytes all the same".to_vec();
        let good = encode_entry(&key, ImageKind::Cubin, &payload);

        // Every proper prefix (a partial write) is rejected.
        for n in 0..good.len() {
            assert!(
                decode_entry(&key, &good[..n]).is_err(),
                "prefix of {n} bytes accepted"
            );
        }
        // Flipping any single bit anywhere is detected.
        for i in 0..good.len() {
            let mut bad = good.clone();
            bad[i] ^= 0x10;
            assert!(
                decode_entry(&key, &bad).is_err(),
                "bit flip at byte {i} accepted"
            );
        }
        // Trailing garbage (e.g. an old longer entry partially overwritten).
        let mut long = good.clone();
        long.push(0);
        assert!(matches!(
            decode_entry(&key, &long),
            Err(EntryError::Length { .. })
        ));
        // A valid entry stored under another key's name.
        assert_eq!(
            decode_entry(&CacheKey([4; 32]), &good),
            Err(EntryError::KeyMismatch)
        );
    }

    #[test]
    fn store_and_lookup_through_the_file_system() {
        let dir = tempfile::tempdir().unwrap();
        let cache = KernelCache::new(dir.path().join("nested").join("cache"));
        let key = CacheKey([9; 32]);
        assert_eq!(cache.lookup(&key).unwrap(), CacheLookup::Miss);

        let image = vec![0xabu8; 4096];
        cache.store(&key, ImageKind::Cubin, &image).unwrap();
        assert_eq!(
            cache.lookup(&key).unwrap(),
            CacheLookup::Hit {
                kind: ImageKind::Cubin,
                image: image.clone()
            }
        );
        // No temporary files are left behind.
        let names: Vec<_> = fs::read_dir(cache.dir())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(
            names,
            vec![std::ffi::OsString::from(format!("{}.img", key.hex()))]
        );

        // A truncated file on disk reads as invalid, and storing again repairs it.
        let path = cache.path_for(&key);
        let full = fs::read(&path).unwrap();
        fs::write(&path, &full[..full.len() / 2]).unwrap();
        assert!(matches!(
            cache.lookup(&key).unwrap(),
            CacheLookup::Invalid(EntryError::Length { .. })
        ));
        fs::write(&path, &full[..10]).unwrap();
        assert!(matches!(
            cache.lookup(&key).unwrap(),
            CacheLookup::Invalid(EntryError::Truncated(10))
        ));
        cache.store(&key, ImageKind::Cubin, &image).unwrap();
        assert!(matches!(
            cache.lookup(&key).unwrap(),
            CacheLookup::Hit { .. }
        ));
    }

    #[test]
    fn concurrent_writers_and_readers_only_see_whole_entries() {
        let dir = tempfile::tempdir().unwrap();
        let cache = KernelCache::new(dir.path());
        let key = CacheKey([1; 32]);
        let image: Vec<u8> = (0..256 * 1024u32).map(|i| (i ^ (i >> 8)) as u8).collect();
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..20 {
                        cache.store(&key, ImageKind::Cubin, &image).unwrap();
                    }
                });
            }
            for _ in 0..2 {
                s.spawn(|| {
                    for _ in 0..200 {
                        match cache.lookup(&key).unwrap() {
                            CacheLookup::Miss => {}
                            CacheLookup::Hit { image: got, .. } => assert!(got == image),
                            CacheLookup::Invalid(e) => panic!("reader saw a partial entry: {e}"),
                        }
                    }
                });
            }
        });
        assert_eq!(fs::read_dir(cache.dir()).unwrap().count(), 1);
    }

    #[test]
    fn unwritable_cache_is_an_error_not_a_panic() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("a-file");
        fs::write(&file, b"x").unwrap();
        let cache = KernelCache::new(file.join("sub"));
        assert!(matches!(
            cache.store(&CacheKey([0; 32]), ImageKind::Ptx, b"x"),
            Err(KernelError::Cache { .. })
        ));
    }
}
