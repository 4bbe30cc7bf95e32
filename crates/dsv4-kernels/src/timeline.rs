//! Timeline builds: every kernel stamps its warps' entry, first dependency wait and exit into
//! a log in device memory (`DSV4_TIMELINE` in `dsv4_common.cuh`), so a CUDA graph's launches
//! can be placed on one clock as they ran. The loader instruments the sources here: each
//! kernel gets `DSV4_TIMELINE_SCOPE(tag)` at its top, its tag a hash of its name.

use std::collections::HashMap;

use crate::FAMILIES;

/// A kernel's tag in the log: the 32-bit FNV-1a hash of its name.
pub fn tag(name: &str) -> u32 {
    name.bytes().fold(0x811c_9dc5u32, |h, b| {
        (h ^ b as u32).wrapping_mul(0x0100_0193)
    })
}

/// Every kernel's name by its tag.
pub fn names() -> HashMap<u32, &'static str> {
    FAMILIES
        .iter()
        .flat_map(|f| f.functions.iter())
        .map(|&n| (tag(n), n))
        .collect()
}

/// `source` with `DSV4_TIMELINE_SCOPE(<tag>u);` right after the opening brace of every kernel
/// defined with `DSV4_KERNEL` (not in comments, in the macro's own definition or in a
/// declaration without a body).
pub fn instrument(source: &str) -> String {
    const MACRO: &str = "DSV4_KERNEL";
    let mut out = String::with_capacity(source.len() + 4096);
    let mut copied = 0;
    let mut from = 0;
    while let Some(at) = source[from..].find(MACRO).map(|i| from + i) {
        from = at + MACRO.len();
        let line = &source[source[..at].rfind('\n').map_or(0, |i| i + 1)..at];
        let in_block_comment = source[..at].rfind("/*") > source[..at].rfind("*/");
        let word_goes_on = source[from..]
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_');
        if line.contains("//")
            || line.trim_start().starts_with('#')
            || in_block_comment
            || word_goes_on
        {
            continue;
        }
        let Some(brace) = source[from..].find('{').map(|i| from + i) else {
            break;
        };
        if source[from..brace].contains(';') {
            continue;
        }
        let Some(name) = kernel_name(&source[from..brace]) else {
            continue;
        };
        out.push_str(&source[copied..=brace]);
        out.push_str(&format!(" DSV4_TIMELINE_SCOPE({}u);", tag(name)));
        copied = brace + 1;
        from = brace + 1;
    }
    out.push_str(&source[copied..]);
    out
}

/// The kernel's name in its declaration between `DSV4_KERNEL` and its body: the identifier
/// before the parameter list, past any `__launch_bounds__(...)`.
fn kernel_name(decl: &str) -> Option<&str> {
    let mut rest = decl;
    if let Some(i) = rest.find("__launch_bounds__") {
        let close = rest[i..].find(')')? + i;
        rest = &rest[close + 1..];
    }
    let open = rest.find('(')?;
    let head = rest[..open].trim_end();
    let start = head
        .rfind(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .map_or(0, |i| i + 1);
    (start < head.len()).then(|| &head[start..])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kernel_gets_one_scope_with_its_own_tag() {
        let names = names();
        assert_eq!(
            names.len(),
            FAMILIES.iter().map(|f| f.functions.len()).sum::<usize>(),
            "tags are distinct"
        );
        for family in FAMILIES {
            let out = instrument(family.source);
            let tags: Vec<u32> = out
                .match_indices("DSV4_TIMELINE_SCOPE(")
                .map(|(i, m)| {
                    let rest = &out[i + m.len()..];
                    rest[..rest.find('u').unwrap()].parse().unwrap()
                })
                .collect();
            let mut got: Vec<&str> = tags.iter().map(|t| names[t]).collect();
            let mut want = family.functions.to_vec();
            got.sort_unstable();
            want.sort_unstable();
            assert_eq!(got, want, "{}", family.name);
            // Nothing but the scopes changed.
            let stripped = tags.iter().fold(out.clone(), |s, t| {
                s.replacen(&format!(" DSV4_TIMELINE_SCOPE({t}u);"), "", 1)
            });
            assert_eq!(stripped, family.source, "{}", family.name);
        }
    }

    #[test]
    fn declarations_in_comments_and_macros_are_left_alone() {
        let src = "#define DSV4_KERNEL extern \"C\" __global__\n\
                   // DSV4_KERNEL void old(float* x) { }\n\
                   DSV4_KERNEL void __launch_bounds__(128, 4) scale(float* x) { x[0] *= 2.0f; }\n\
                   DSV4_KERNEL void\n    copy(const float* a,\n float* b) {\n b[0] = a[0];\n}\n";
        let out = instrument(src);
        assert_eq!(out.matches("DSV4_TIMELINE_SCOPE(").count(), 2, "{out}");
        assert!(out.contains(&format!(
            "scale(float* x) {{ DSV4_TIMELINE_SCOPE({}u);",
            tag("scale")
        )));
        assert!(out.contains(&format!(
            "float* b) {{ DSV4_TIMELINE_SCOPE({}u);",
            tag("copy")
        )));
        assert!(out.contains("// DSV4_KERNEL void old(float* x) { }\n"));
        // A block comment, a longer name and a declaration without a body are no kernels.
        let src = "/* DSV4_KERNEL void a(float* x) { } */\n\
                   #define DSV4_KERNEL_BOUNDS 128\n\
                   DSV4_KERNEL void ahead(float* x);\n\
                   DSV4_KERNEL void ahead(float* x) { x[0] = 0.0f; }\n";
        let out = instrument(src);
        assert_eq!(out.matches("DSV4_TIMELINE_SCOPE(").count(), 1, "{out}");
        assert!(out.contains(&format!(
            "ahead(float* x) {{ DSV4_TIMELINE_SCOPE({}u);",
            tag("ahead")
        )));
    }
}
