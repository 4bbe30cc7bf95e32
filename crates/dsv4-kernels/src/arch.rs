use std::fmt;

use crate::KernelError;

/// The code NVRTC is asked to produce.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Arch {
    /// Hopper (compute capability 9.0), with the arch-specific features (wgmma, setmaxnreg).
    Sm90a,
    /// Blackwell datacenter (compute capability 10.0), with tcgen05.
    Sm100a,
    /// Any other device: PTX for `compute_<major><minor>`, finished by the driver's JIT.
    Ptx { major: u32, minor: u32 },
}

/// What a compiled image holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ImageKind {
    Cubin,
    Ptx,
}

impl Arch {
    /// The architecture to compile for on a device of compute capability `major.minor`.
    pub fn for_compute_capability(major: u32, minor: u32) -> Arch {
        match (major, minor) {
            (9, 0) => Arch::Sm90a,
            (10, 0) => Arch::Sm100a,
            _ => Arch::Ptx { major, minor },
        }
    }

    /// Parses `sm_90a`, `sm_100a` or `compute_<major><minor>` (the last digit is the minor).
    pub fn parse(s: &str) -> Result<Arch, KernelError> {
        let bad = || KernelError::BadArch(s.to_string());
        match s {
            "sm_90a" => Ok(Arch::Sm90a),
            "sm_100a" => Ok(Arch::Sm100a),
            _ => {
                let digits = s.strip_prefix("compute_").ok_or_else(bad)?;
                if digits.len() < 2 || !digits.bytes().all(|b| b.is_ascii_digit()) {
                    return Err(bad());
                }
                let (major, minor) = digits.split_at(digits.len() - 1);
                Ok(Arch::Ptx {
                    major: major.parse().map_err(|_| bad())?,
                    minor: minor.parse().map_err(|_| bad())?,
                })
            }
        }
    }

    /// The value of NVRTC's `--gpu-architecture`.
    pub fn nvrtc_target(&self) -> String {
        match self {
            Arch::Sm90a => "sm_90a".into(),
            Arch::Sm100a => "sm_100a".into(),
            Arch::Ptx { major, minor } => format!("compute_{major}{minor}"),
        }
    }

    /// Whether the device runs thread-block clusters (compute capability 9.0 and later).
    pub fn has_clusters(&self) -> bool {
        match self {
            Arch::Sm90a | Arch::Sm100a => true,
            Arch::Ptx { major, .. } => *major >= 9,
        }
    }

    pub fn image_kind(&self) -> ImageKind {
        match self {
            Arch::Sm90a | Arch::Sm100a => ImageKind::Cubin,
            Arch::Ptx { .. } => ImageKind::Ptx,
        }
    }
}

impl fmt::Display for Arch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.nvrtc_target())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_to_target() {
        assert_eq!(Arch::for_compute_capability(9, 0), Arch::Sm90a);
        assert_eq!(Arch::for_compute_capability(10, 0), Arch::Sm100a);
        assert!(Arch::Sm90a.has_clusters() && Arch::for_compute_capability(12, 0).has_clusters());
        assert!(!Arch::for_compute_capability(8, 9).has_clusters());
        let ada = Arch::for_compute_capability(8, 9);
        assert_eq!(ada.nvrtc_target(), "compute_89");
        assert_eq!(ada.image_kind(), ImageKind::Ptx);
        assert_eq!(
            Arch::for_compute_capability(12, 0).nvrtc_target(),
            "compute_120"
        );
        assert_eq!(Arch::Sm100a.image_kind(), ImageKind::Cubin);
    }

    #[test]
    fn parse_round_trips() {
        for a in [
            Arch::Sm90a,
            Arch::Sm100a,
            Arch::Ptx { major: 8, minor: 9 },
            Arch::Ptx {
                major: 12,
                minor: 0,
            },
        ] {
            assert_eq!(Arch::parse(&a.to_string()).unwrap(), a);
        }
        for bad in ["sm_90", "compute_", "compute_9", "compute_9x", "hopper"] {
            assert!(Arch::parse(bad).is_err(), "{bad}");
        }
    }
}
