//! Reading the fenced code blocks of a Markdown document, for the tests that run the README.

/// The fenced blocks of `text` as (info string, content), in order.
pub(crate) fn fenced_blocks(text: &str) -> Vec<(String, String)> {
    let mut blocks = Vec::new();
    let mut open: Option<(String, String)> = None;
    for line in text.lines() {
        match open.as_mut() {
            None => {
                if let Some(info) = line.strip_prefix("```") {
                    open = Some((info.trim().to_owned(), String::new()));
                }
            }
            Some((_, content)) => {
                if line.starts_with("```") {
                    blocks.extend(open.take());
                } else {
                    content.push_str(line);
                    content.push('\n');
                }
            }
        }
    }
    blocks
}
