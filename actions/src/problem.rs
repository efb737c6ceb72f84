//! KernelBench problems: parsing the JSONL form, naming, lookup.

use std::fmt;

use serde::Deserialize;

/// One KernelBench problem: a PyTorch program defining `Model`,
/// `get_inputs()` and `get_init_inputs()`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    /// Level 1, 2 or 3.
    pub level: u32,
    /// The number prefix of the file name, unique within a level.
    pub number: u32,
    /// File name without `.py`, e.g. `1_Conv2D_ReLU_BiasAdd`.
    pub name: String,
    /// The program text.
    pub code: String,
}

impl Problem {
    /// Short id, e.g. `L2/1`.
    pub fn id(&self) -> String {
        format!("L{}/{}", self.level, self.number)
    }

    /// Level and file name, e.g. `L2/1_Conv2D_ReLU_BiasAdd`.
    pub fn full_name(&self) -> String {
        format!("L{}/{}", self.level, self.name)
    }
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.full_name())
    }
}

/// Why problems could not be read or found.
#[derive(Debug, thiserror::Error)]
pub enum ProblemError {
    /// A JSONL line is not a problem object.
    #[error("line {line}: {reason}")]
    BadLine {
        /// 1-based line number.
        line: usize,
        /// What is wrong with it.
        reason: String,
    },
    /// A file name does not start with the problem number.
    #[error(
        "`{name}` does not start with a problem number (KernelBench files are named like `19_ReLU.py`)"
    )]
    BadFileName {
        /// The file name.
        name: String,
    },
    /// Two problems share a level and number.
    #[error("L{level}/{number} appears twice (`{first}` and `{second}`)")]
    Duplicate {
        /// Level.
        level: u32,
        /// Number.
        number: u32,
        /// First name.
        first: String,
        /// Second name.
        second: String,
    },
    /// No problem matches a name.
    #[error("no problem named `{query}`{}", suggest(.suggestions))]
    Unknown {
        /// What was asked for.
        query: String,
        /// Close matches.
        suggestions: Vec<String>,
    },
    /// A level with no problems.
    #[error("no problem named `{query}`: the problems have no level {level} (levels: {levels})")]
    NoLevel {
        /// What was asked for.
        query: String,
        /// The level asked for.
        level: u32,
        /// The levels present.
        levels: String,
    },
    /// A name matches problems of several levels.
    #[error("`{query}` is ambiguous: it names {}; add the level, e.g. `{}`", .matches.join(", "), .matches[0])]
    Ambiguous {
        /// What was asked for.
        query: String,
        /// The problems it matches.
        matches: Vec<String>,
    },
}

fn suggest(s: &[String]) -> String {
    if s.is_empty() {
        "; `mtmc problems` lists them".to_string()
    } else {
        format!("; did you mean {}?", s.join(", "))
    }
}

#[derive(Deserialize)]
struct JsonProblem {
    level: u32,
    problem_id: u32,
    name: String,
    code: String,
}

/// Parses KernelBench's `problems.jsonl` (one `{level, problem_id, name, code}`
/// object per line; blank lines are skipped).
pub fn parse_jsonl(text: &str) -> Result<Vec<Problem>, ProblemError> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let p: JsonProblem = serde_json::from_str(line).map_err(|e| ProblemError::BadLine {
            line: i + 1,
            reason: e.to_string(),
        })?;
        if !(1..=4).contains(&p.level) {
            return Err(ProblemError::BadLine {
                line: i + 1,
                reason: format!("level {} is not a KernelBench level (1-4)", p.level),
            });
        }
        out.push(Problem {
            level: p.level,
            number: p.problem_id,
            name: p.name,
            code: p.code,
        });
    }
    check_unique(&out)?;
    Ok(out)
}

/// A problem from a file of a KernelBench checkout (`level2/1_Conv2D_ReLU_BiasAdd.py`).
pub fn problem_from_file(
    level: u32,
    file_name: &str,
    code: String,
) -> Result<Problem, ProblemError> {
    let name = file_name
        .strip_suffix(".py")
        .unwrap_or(file_name)
        .to_string();
    let number = name
        .split('_')
        .next()
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| ProblemError::BadFileName {
            name: file_name.to_string(),
        })?;
    Ok(Problem {
        level,
        number,
        name,
        code,
    })
}

/// Fails when two problems share a level and number.
pub fn check_unique(problems: &[Problem]) -> Result<(), ProblemError> {
    let mut seen = std::collections::HashMap::new();
    for p in problems {
        if let Some(first) = seen.insert((p.level, p.number), &p.name) {
            return Err(ProblemError::Duplicate {
                level: p.level,
                number: p.number,
                first: first.clone(),
                second: p.name.clone(),
            });
        }
    }
    Ok(())
}

/// Finds a problem by `L2/1`, `L2/1_Conv2D_ReLU_BiasAdd`, `level2/1_…py`, or a
/// file name alone (`1_Conv2D_ReLU_BiasAdd`, unique across levels).
pub fn find<'a>(problems: &'a [Problem], query: &str) -> Result<&'a Problem, ProblemError> {
    let q = query.trim().trim_end_matches(".py");
    let (level, rest) = split_level(q);
    let matches: Vec<&Problem> = problems
        .iter()
        .filter(|p| level.is_none_or(|l| l == p.level))
        .filter(|p| {
            p.name.eq_ignore_ascii_case(rest)
                || (level.is_some() && rest.parse::<u32>().is_ok_and(|n| n == p.number))
        })
        .collect();
    match matches.as_slice() {
        [one] => Ok(one),
        [] => {
            if let Some(l) = level.filter(|l| !problems.iter().any(|p| p.level == *l)) {
                let mut levels: Vec<u32> = problems.iter().map(|p| p.level).collect();
                levels.sort_unstable();
                levels.dedup();
                let levels: Vec<String> = levels.iter().map(u32::to_string).collect();
                return Err(ProblemError::NoLevel {
                    query: query.to_string(),
                    level: l,
                    levels: levels.join(", "),
                });
            }
            let needle = rest.to_ascii_lowercase();
            let searchable = needle.len() >= 3 && !needle.chars().all(|c| c.is_ascii_digit());
            let name_of = |p: &Problem| p.name.to_ascii_lowercase();
            // Names containing the query; failing that, names whose words
            // (after the number) the query contains.
            let mut suggestions: Vec<String> = problems
                .iter()
                .filter(|p| searchable && name_of(p).contains(&needle))
                .map(Problem::full_name)
                .collect();
            if suggestions.is_empty() {
                suggestions = problems
                    .iter()
                    .filter(|p| {
                        name_of(p).split_once('_').is_some_and(|(_, words)| {
                            words.len() >= 4 && searchable && needle.contains(words)
                        })
                    })
                    .map(Problem::full_name)
                    .collect();
            }
            suggestions.truncate(5);
            Err(ProblemError::Unknown {
                query: query.to_string(),
                suggestions,
            })
        }
        many => Err(ProblemError::Ambiguous {
            query: query.to_string(),
            matches: many.iter().map(|p| p.full_name()).collect(),
        }),
    }
}

/// Splits `L2/rest`, `l2/rest`, `level2/rest` into the level and the rest.
fn split_level(q: &str) -> (Option<u32>, &str) {
    if let Some((head, rest)) = q.split_once('/') {
        let head = head.to_ascii_lowercase();
        let digits = head
            .strip_prefix("level")
            .or_else(|| head.strip_prefix('l'))
            .unwrap_or(&head);
        if let Ok(l) = digits.parse() {
            return (Some(l), rest);
        }
    }
    (None, q)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set() -> Vec<Problem> {
        parse_jsonl(concat!(
            r#"{"level":1,"problem_id":19,"name":"19_ReLU","code":"a"}"#,
            "\n\n",
            r#"{"level":2,"problem_id":1,"name":"1_Conv2D_ReLU_BiasAdd","code":"b"}"#,
            "\n",
            r#"{"level":3,"problem_id":1,"name":"1_MLP","code":"c"}"#,
            "\n",
            r#"{"level":1,"problem_id":1,"name":"1_MLP","code":"d"}"#,
        ))
        .unwrap()
    }

    #[test]
    fn problems_are_found_by_id_by_name_and_by_file_path() {
        let s = set();
        assert_eq!(find(&s, "L2/1").unwrap().name, "1_Conv2D_ReLU_BiasAdd");
        assert_eq!(find(&s, "l1/19").unwrap().id(), "L1/19");
        assert_eq!(find(&s, "19_ReLU").unwrap().id(), "L1/19");
        assert_eq!(
            find(&s, "level2/1_Conv2D_ReLU_BiasAdd.py").unwrap().id(),
            "L2/1"
        );
        assert_eq!(find(&s, "L3/1_MLP").unwrap().code, "c");
    }

    #[test]
    fn unknown_and_ambiguous_names_say_what_to_do() {
        let s = set();
        let e = find(&s, "ReLU").unwrap_err().to_string();
        assert_eq!(
            e,
            "no problem named `ReLU`; did you mean L1/19_ReLU, L2/1_Conv2D_ReLU_BiasAdd?"
        );
        let e = find(&s, "L9/1").unwrap_err().to_string();
        assert_eq!(
            e,
            "no problem named `L9/1`: the problems have no level 9 (levels: 1, 2, 3)"
        );
        let e = find(&s, "L1/77").unwrap_err().to_string();
        assert_eq!(e, "no problem named `L1/77`; `mtmc problems` lists them");
        let e = find(&s, "1_MLP").unwrap_err().to_string();
        assert_eq!(
            e,
            "`1_MLP` is ambiguous: it names L3/1_MLP, L1/1_MLP; add the level, e.g. `L3/1_MLP`"
        );
    }

    #[test]
    fn a_malformed_line_is_named_by_its_number() {
        let e =
            parse_jsonl("{\"level\":1,\"problem_id\":1,\"name\":\"a\",\"code\":\"\"}\n{oops}\n")
                .unwrap_err();
        assert!(e.to_string().starts_with("line 2: "), "{e}");
        let e = parse_jsonl(r#"{"level":7,"problem_id":1,"name":"a","code":""}"#).unwrap_err();
        assert_eq!(
            e.to_string(),
            "line 1: level 7 is not a KernelBench level (1-4)"
        );
    }

    #[test]
    fn duplicate_ids_are_refused() {
        let e = parse_jsonl(concat!(
            r#"{"level":1,"problem_id":1,"name":"1_A","code":""}"#,
            "\n",
            r#"{"level":1,"problem_id":1,"name":"1_B","code":""}"#
        ))
        .unwrap_err();
        assert_eq!(e.to_string(), "L1/1 appears twice (`1_A` and `1_B`)");
    }

    #[test]
    fn file_names_give_the_number() {
        let p = problem_from_file(2, "12_Gemm_Multiply_LeakyReLU.py", String::new()).unwrap();
        assert_eq!(p.id(), "L2/12");
        assert!(problem_from_file(2, "helpers.py", String::new()).is_err());
    }
}
