//! The code in a reply: fenced blocks among prose, the block that defines
//! what was asked for when there are several, and the unclosed block of a
//! reply cut off at the token limit.

/// A fenced block: its language tag and its text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Block {
    /// The tag after the opening fence (`cuda`, `cpp`, …), lower case.
    pub lang: String,
    /// The code.
    pub code: String,
    /// Whether the closing fence was missing (a cut-off reply).
    pub unclosed: bool,
}

/// Every fenced block of `reply`, in order. A block left open at the end
/// runs to the end of the reply.
pub fn blocks(reply: &str) -> Vec<Block> {
    let mut out = Vec::new();
    let mut open: Option<(String, String, usize)> = None;
    for line in reply.lines() {
        let t = line.trim_start();
        match &mut open {
            None => {
                if let Some(rest) = t.strip_prefix("```") {
                    let fence = 3 + rest.chars().take_while(|&c| c == '`').count();
                    let tag = rest.trim_start_matches('`').trim().to_ascii_lowercase();
                    open = Some((tag, String::new(), fence));
                }
            }
            Some((tag, code, fence)) => {
                let ticks = t.chars().take_while(|&c| c == '`').count();
                if ticks >= *fence && t[ticks..].trim().is_empty() {
                    out.push(Block {
                        lang: std::mem::take(tag),
                        code: std::mem::take(code),
                        unclosed: false,
                    });
                    open = None;
                } else {
                    code.push_str(line);
                    code.push('\n');
                }
            }
        }
    }
    if let Some((lang, code, _)) = open
        && !code.trim().is_empty()
    {
        out.push(Block {
            lang,
            code,
            unclosed: true,
        });
    }
    out
}

/// The code for `wanted` in `reply`: the last block `defines` accepts
/// (a later block is usually the corrected one), else the only block,
/// else, with no fences at all, the reply itself when `defines` accepts
/// it. `None` when nothing fits.
pub fn code_for(reply: &str, defines: impl Fn(&str) -> bool) -> Option<Block> {
    let all = blocks(reply);
    if let Some(b) = all.iter().rev().find(|b| defines(&b.code)) {
        return Some(b.clone());
    }
    if all.is_empty() && defines(reply) {
        return Some(Block {
            lang: String::new(),
            code: reply.trim().to_string() + "\n",
            unclosed: false,
        });
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kernel(code: &str) -> bool {
        code.contains("__global__") && code.contains("k0(")
    }

    #[test]
    fn the_block_defining_the_kernel_wins_over_prose_and_other_blocks() {
        let reply = "Here is how to call it:\n```python\nmod.k0(x)\n```\nAnd the kernel:\n```cuda\nextern \"C\" __global__ void k0(float* y) { y[0] = 1; }\n```\nDone.";
        let b = code_for(reply, kernel).unwrap();
        assert_eq!(b.lang, "cuda");
        assert!(b.code.starts_with("extern"));
        assert!(!b.unclosed);
    }

    #[test]
    fn the_last_of_two_kernel_blocks_is_taken() {
        let reply = "```cuda\n__global__ void k0(int a) { bad }\n```\nFixed:\n```cuda\n__global__ void k0(int a) { good(); }\n```\n";
        assert!(code_for(reply, kernel).unwrap().code.contains("good"));
    }

    #[test]
    fn a_cut_off_block_runs_to_the_end() {
        let reply = "```cuda\nextern \"C\" __global__ void k0(float* y) {\n  y[0] =";
        let b = code_for(reply, kernel).unwrap();
        assert!(b.unclosed);
        assert!(b.code.contains("y[0] ="));
    }

    #[test]
    fn bare_code_is_taken_and_garbage_is_not() {
        assert!(code_for("extern \"C\" __global__ void k0(float* y) {}", kernel).is_some());
        assert!(code_for("I cannot help with that.", kernel).is_none());
        assert!(code_for("```\nint main() {}\n```", kernel).is_none());
    }

    #[test]
    fn longer_fences_hold_shorter_ones() {
        let reply = "````cuda\n// ```\n__global__ void k0() {}\n````\n";
        let b = code_for(reply, kernel).unwrap();
        assert!(b.code.contains("// ```"));
    }
}
