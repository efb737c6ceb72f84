//! Tokens and syntax tree of the intent language, and its parser.

use super::{ErrorKind, IntentError, Pos};

#[derive(Clone, Debug, PartialEq)]
pub(super) enum Tok {
    Ident(String),
    Num(f64, bool),
    Sym(&'static str),
    Newline,
    Eof,
}

impl Tok {
    fn describe(&self) -> String {
        match self {
            Tok::Ident(s) => format!("`{s}`"),
            Tok::Num(n, _) => format!("`{n}`"),
            Tok::Sym(s) => format!("`{s}`"),
            Tok::Newline => "end of line".into(),
            Tok::Eof => "end of input".into(),
        }
    }
}

const SYMBOLS: [&str; 16] = [
    "**", "=", "+", "-", "*", "/", "@", "(", ")", "[", "]", ",", ":", ".", ";", "!",
];

pub(super) fn lex(src: &str) -> Result<Vec<(Tok, Pos)>, IntentError> {
    let mut out = Vec::new();
    for (li, line) in src.lines().enumerate() {
        let chars: Vec<char> = line.chars().collect();
        let mut i = 0;
        while i < chars.len() {
            let c = chars[i];
            let pos = Pos {
                line: li + 1,
                column: i + 1,
            };
            if c == '#' {
                break;
            } else if c.is_whitespace() {
                i += 1;
            } else if c.is_ascii_alphabetic() || c == '_' {
                let start = i;
                while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '_') {
                    i += 1;
                }
                out.push((Tok::Ident(chars[start..i].iter().collect()), pos));
            } else if c.is_ascii_digit() {
                let start = i;
                let mut float = false;
                while i < chars.len() {
                    let d = chars[i];
                    let exp_sign =
                        (d == '-' || d == '+') && i > start && matches!(chars[i - 1], 'e' | 'E');
                    if d.is_ascii_digit() || exp_sign {
                        i += 1;
                    } else if (d == '.' && chars.get(i + 1).is_some_and(char::is_ascii_digit))
                        || ((d == 'e' || d == 'E') && i > start)
                    {
                        float = true;
                        i += 1;
                    } else {
                        break;
                    }
                }
                let text: String = chars[start..i].iter().collect();
                let n = text.parse::<f64>().map_err(|_| {
                    IntentError::new(pos, ErrorKind::Lex, format!("`{text}` is not a number"))
                })?;
                out.push((Tok::Num(n, float), pos));
            } else if let Some(sym) = SYMBOLS.iter().find(|s| {
                let s: Vec<char> = s.chars().collect();
                chars[i..].starts_with(&s)
            }) {
                i += sym.len();
                out.push((Tok::Sym(sym), pos));
            } else {
                return Err(IntentError::new(
                    pos,
                    ErrorKind::Lex,
                    format!("unexpected character `{c}`"),
                ));
            }
        }
        out.push((
            Tok::Newline,
            Pos {
                line: li + 1,
                column: chars.len() + 1,
            },
        ));
    }
    let end = out.last().map_or(Pos { line: 1, column: 1 }, |(_, p)| *p);
    out.push((Tok::Eof, end));
    Ok(out)
}

/// A statement.
#[derive(Clone, Debug)]
pub(super) enum Stmt {
    /// `x: f32[m=4096, k]`
    Decl {
        name: String,
        dtype: Option<(String, Pos)>,
        dims: Vec<DimSpec>,
        pos: Pos,
    },
    /// `y = expr`
    Assign { name: String, expr: Expr, pos: Pos },
}

/// One dim of a declaration: `m=4096`, `4096` or `m` (bound earlier).
#[derive(Clone, Debug)]
pub(super) struct DimSpec {
    pub name: Option<String>,
    pub size: Option<u64>,
    pub pos: Pos,
}

#[derive(Clone, Debug)]
pub(super) enum Expr {
    Num(f64, Pos),
    Var(String, Pos),
    Neg(Box<Expr>, Pos),
    Bin(&'static str, Box<Expr>, Box<Expr>, Pos),
    Call(String, Vec<Arg>, Pos),
    Transpose(Box<Expr>, Pos),
    List(Vec<Expr>, Pos),
}

impl Expr {
    pub fn pos(&self) -> Pos {
        match self {
            Expr::Num(_, p)
            | Expr::Var(_, p)
            | Expr::Neg(_, p)
            | Expr::Bin(_, _, _, p)
            | Expr::Call(_, _, p)
            | Expr::Transpose(_, p)
            | Expr::List(_, p) => *p,
        }
    }
}

#[derive(Clone, Debug)]
pub(super) struct Arg {
    pub name: Option<String>,
    pub value: Expr,
    pub pos: Pos,
}

pub(super) struct Parser {
    toks: Vec<(Tok, Pos)>,
    at: usize,
}

impl Parser {
    pub fn new(toks: Vec<(Tok, Pos)>) -> Parser {
        Parser { toks, at: 0 }
    }

    fn peek(&self) -> &Tok {
        &self.toks[self.at].0
    }

    fn peek2(&self) -> &Tok {
        &self.toks[(self.at + 1).min(self.toks.len() - 1)].0
    }

    fn pos(&self) -> Pos {
        self.toks[self.at].1
    }

    fn bump(&mut self) -> (Tok, Pos) {
        let t = self.toks[self.at].clone();
        if self.at + 1 < self.toks.len() {
            self.at += 1;
        }
        t
    }

    fn expected(&self, what: &str) -> IntentError {
        IntentError::new(
            self.pos(),
            ErrorKind::Syntax,
            format!("expected {what}, found {}", self.peek().describe()),
        )
    }

    fn eat(&mut self, sym: &str) -> bool {
        if matches!(self.peek(), Tok::Sym(s) if *s == sym) {
            self.bump();
            true
        } else {
            false
        }
    }

    fn expect(&mut self, sym: &'static str, context: &str) -> Result<(), IntentError> {
        if self.eat(sym) {
            Ok(())
        } else {
            Err(self.expected(&format!("`{sym}` {context}")))
        }
    }

    fn ident(&mut self, what: &str) -> Result<(String, Pos), IntentError> {
        match self.peek().clone() {
            Tok::Ident(s) => {
                let p = self.pos();
                self.bump();
                Ok((s, p))
            }
            _ => Err(self.expected(what)),
        }
    }

    pub fn program(&mut self) -> Result<Vec<Stmt>, IntentError> {
        let mut stmts = Vec::new();
        loop {
            while matches!(self.peek(), Tok::Newline) || *self.peek() == Tok::Sym(";") {
                self.bump();
            }
            if *self.peek() == Tok::Eof {
                return Ok(stmts);
            }
            stmts.push(self.statement()?);
            match self.peek() {
                Tok::Newline | Tok::Eof => {}
                Tok::Sym(";") => {}
                _ => return Err(self.expected("end of statement (a new line or `;`)")),
            }
        }
    }

    fn statement(&mut self) -> Result<Stmt, IntentError> {
        let (name, pos) = self.ident("a statement (`name = expression` or `name: [dims]`)")?;
        if self.eat(":") {
            let dtype = match self.peek().clone() {
                Tok::Ident(d) => {
                    let p = self.pos();
                    self.bump();
                    Some((d, p))
                }
                _ => None,
            };
            self.expect("[", "to open the dims of the declaration")?;
            let mut dims = Vec::new();
            if !self.eat("]") {
                loop {
                    dims.push(self.dim_spec()?);
                    if self.eat("]") {
                        break;
                    }
                    self.expect(",", "or `]` in the dims")?;
                }
            }
            return Ok(Stmt::Decl {
                name,
                dtype,
                dims,
                pos,
            });
        }
        self.expect("=", &format!("or `:` after `{name}`"))?;
        let expr = self.expr()?;
        Ok(Stmt::Assign { name, expr, pos })
    }

    fn dim_spec(&mut self) -> Result<DimSpec, IntentError> {
        let pos = self.pos();
        match self.peek().clone() {
            Tok::Num(n, false) => {
                self.bump();
                Ok(DimSpec {
                    name: None,
                    size: Some(n as u64),
                    pos,
                })
            }
            Tok::Ident(name) => {
                self.bump();
                let size = if self.eat("=") {
                    match self.bump() {
                        (Tok::Num(n, false), _) => Some(n as u64),
                        (t, p) => {
                            return Err(IntentError::new(
                                p,
                                ErrorKind::Syntax,
                                format!(
                                    "expected a dim size after `{name}=`, found {}",
                                    t.describe()
                                ),
                            ));
                        }
                    }
                } else {
                    None
                };
                Ok(DimSpec {
                    name: Some(name),
                    size,
                    pos,
                })
            }
            _ => Err(self.expected("a dim (`4096`, `m=4096` or `m`)")),
        }
    }

    pub fn expr(&mut self) -> Result<Expr, IntentError> {
        let mut lhs = self.term()?;
        loop {
            let pos = self.pos();
            let op = match self.peek() {
                Tok::Sym("+") => "+",
                Tok::Sym("-") => "-",
                _ => return Ok(lhs),
            };
            self.bump();
            let rhs = self.term()?;
            lhs = Expr::Bin(op, Box::new(lhs), Box::new(rhs), pos);
        }
    }

    fn term(&mut self) -> Result<Expr, IntentError> {
        let mut lhs = self.unary()?;
        loop {
            let pos = self.pos();
            let op = match self.peek() {
                Tok::Sym("*") => "*",
                Tok::Sym("/") => "/",
                Tok::Sym("@") => "@",
                _ => return Ok(lhs),
            };
            self.bump();
            let rhs = self.unary()?;
            lhs = Expr::Bin(op, Box::new(lhs), Box::new(rhs), pos);
        }
    }

    fn unary(&mut self) -> Result<Expr, IntentError> {
        let pos = self.pos();
        if self.eat("-") {
            return Ok(Expr::Neg(Box::new(self.unary()?), pos));
        }
        let base = self.postfix()?;
        let pos = self.pos();
        if self.eat("**") {
            let exp = self.unary()?;
            return Ok(Expr::Bin("**", Box::new(base), Box::new(exp), pos));
        }
        Ok(base)
    }

    fn postfix(&mut self) -> Result<Expr, IntentError> {
        let mut e = self.atom()?;
        while *self.peek() == Tok::Sym(".") {
            let pos = self.pos();
            self.bump();
            match self.bump() {
                (Tok::Ident(s), _) if s == "T" => e = Expr::Transpose(Box::new(e), pos),
                (t, p) => {
                    return Err(IntentError::new(
                        p,
                        ErrorKind::Syntax,
                        format!("expected `T` after `.`, found {}", t.describe()),
                    ));
                }
            }
        }
        Ok(e)
    }

    fn atom(&mut self) -> Result<Expr, IntentError> {
        let pos = self.pos();
        match self.peek().clone() {
            Tok::Num(n, _) => {
                self.bump();
                Ok(Expr::Num(n, pos))
            }
            Tok::Ident(name) => {
                self.bump();
                if self.eat("(") {
                    let args = self.args(&name)?;
                    Ok(Expr::Call(name, args, pos))
                } else {
                    Ok(Expr::Var(name, pos))
                }
            }
            Tok::Sym("(") => {
                self.bump();
                let e = self.expr()?;
                self.expect(")", "to close the parenthesis")?;
                Ok(e)
            }
            Tok::Sym("[") => {
                self.bump();
                let mut items = Vec::new();
                if !self.eat("]") {
                    loop {
                        items.push(self.expr()?);
                        if self.eat("]") {
                            break;
                        }
                        self.expect(",", "or `]` in the list")?;
                    }
                }
                Ok(Expr::List(items, pos))
            }
            _ => Err(self.expected("an expression")),
        }
    }

    fn args(&mut self, func: &str) -> Result<Vec<Arg>, IntentError> {
        let mut args = Vec::new();
        if self.eat(")") {
            return Ok(args);
        }
        loop {
            let pos = self.pos();
            let name = match (self.peek().clone(), self.peek2()) {
                (Tok::Ident(n), Tok::Sym("=")) => {
                    self.bump();
                    self.bump();
                    Some(n)
                }
                _ => None,
            };
            let value = self.expr()?;
            args.push(Arg { name, value, pos });
            if self.eat(")") {
                return Ok(args);
            }
            if !self.eat(",") {
                return Err(self.expected(&format!("`,` or `)` in the arguments of `{func}`")));
            }
        }
    }
}
