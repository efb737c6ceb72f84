//! The files commands write: `--out` folders and result files appended to
//! a line at a time.

/// Why `path` cannot be an `--out` folder (it is a file), if it cannot.
pub fn out_dir_refused(path: &std::path::Path) -> Option<String> {
    (path.exists() && !path.is_dir()).then(|| {
        format!(
            "`{}` is a file: --out names the folder to write to; pass a new folder's name",
            path.display()
        )
    })
}

/// `path` opened to append lines to (created when missing): the files a
/// resumable command keeps its finished results in, a line each.
pub fn open_to_append(path: &std::path::Path) -> anyhow::Result<std::fs::File> {
    use anyhow::Context as _;
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .with_context(|| format!("cannot open `{}`", path.display()))
}
