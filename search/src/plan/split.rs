//! The fixed split of problems into training, validation and test, and
//! the level filter.

/// Whether the problem `name` (`L2/76_…`) is of one of `levels` (of any
/// level when `levels` is empty).
pub fn of_levels(name: &str, levels: &[u32]) -> bool {
    levels.is_empty()
        || name
            .strip_prefix('L')
            .and_then(|n| n.split_once('/'))
            .and_then(|(l, _)| l.parse().ok())
            .is_some_and(|l| levels.contains(&l))
}

/// Words for the levels a comparison was limited to (none when every
/// level counts): ", level 3" or ", levels 1, 2".
pub fn levels_words(levels: &[u32]) -> String {
    match levels {
        [] => String::new(),
        [l] => format!(", level {l}"),
        ls => format!(
            ", levels {}",
            ls.iter().map(u32::to_string).collect::<Vec<_>>().join(", ")
        ),
    }
}

/// The fixed train/test rule: a problem is held out for testing when the
/// first byte of the SHA-256 of its full name (`L2/76_…`) is a multiple of
/// 5 (about one problem in five).
pub fn held_out(name: &str) -> bool {
    first_byte(name).is_multiple_of(5)
}

/// The validation rule: a training problem whose first SHA-256 byte is 1
/// mod 5 (about one training problem in four). `train --validation` leaves
/// these out, so that settings can be chosen on them without looking at
/// the held-out problems.
pub fn validation(name: &str) -> bool {
    first_byte(name) % 5 == 1
}

fn first_byte(name: &str) -> u8 {
    let hex = crate::source::sha256_hex(name);
    u8::from_str_radix(&hex[..2], 16).expect("a SHA-256 in hex")
}

/// Which problems a command takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Split {
    /// Problems not held out.
    Train,
    /// Held-out problems.
    Test,
    /// The training problems `train --validation` leaves out.
    Validation,
    /// Every problem.
    All,
}

impl Split {
    pub(crate) fn keeps(self, name: &str) -> bool {
        match self {
            Split::Train => !held_out(name),
            Split::Test => held_out(name),
            Split::Validation => validation(name),
            Split::All => true,
        }
    }

    /// Whether the knowledge base reads `name`'s recorded steps for a
    /// search on this split: the training problems', less the validation
    /// problems' when those are searched. A held-out problem's outcomes
    /// never reach a planner's observations.
    pub fn knows(self, name: &str) -> bool {
        !(held_out(name) || self == Split::Validation && validation(name))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_level_filter_reads_the_level_from_the_name() {
        assert!(of_levels("L3/4_LeNet5", &[]));
        assert!(of_levels("L3/4_LeNet5", &[1, 3]));
        assert!(!of_levels("L3/4_LeNet5", &[1, 2]));
        assert!(!of_levels("L13/4_x", &[1, 3]));
        assert!(!of_levels("my_problem.py", &[1]));
        assert_eq!(levels_words(&[]), "");
        assert_eq!(levels_words(&[3]), ", level 3");
        assert_eq!(levels_words(&[1, 2]), ", levels 1, 2");
    }

    #[test]
    fn the_validation_problems_are_training_problems_set_apart_by_rule() {
        let names: Vec<String> = (1..=100)
            .flat_map(|i| [format!("L1/{i}_a"), format!("L2/{i}_b")])
            .collect();
        let test = names.iter().filter(|n| held_out(n)).count();
        let set_apart = names.iter().filter(|n| validation(n)).count();
        assert!(names.iter().all(|n| !(held_out(n) && validation(n))));
        // About a fifth each.
        assert!((20..=60).contains(&test), "{test}");
        assert!((20..=60).contains(&set_apart), "{set_apart}");
        // Validation problems are training problems: `--split train` (and
        // a training run without `--validation`) keeps them.
        let v = names.iter().find(|n| validation(n)).unwrap();
        assert!(Split::Train.keeps(v) && !Split::Test.keeps(v), "{v}");
        assert!(held_out("L2/76_Gemm_Add_ReLU") && !validation("L2/76_Gemm_Add_ReLU"));
        assert!(!held_out("L1/24_LogSoftmax") && !validation("L1/24_LogSoftmax"));
    }
}
