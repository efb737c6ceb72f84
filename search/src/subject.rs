//! The subject of a command: a KernelBench problem by name, or an intent
//! program with the shapes of its inputs.

/// What a command works on: a KernelBench problem or an intent program.
pub enum Subject<'a> {
    /// A KernelBench problem by name.
    Problem {
        /// Problems path, if given.
        kernelbench: Option<&'a std::path::Path>,
        /// The name.
        name: &'a str,
    },
    /// An intent program.
    Intent {
        /// The program text.
        text: String,
        /// Where it came from, for error messages.
        origin: String,
        /// Shapes of undeclared inputs.
        bindings: mtmc_actions::intent::Bindings,
    },
}
