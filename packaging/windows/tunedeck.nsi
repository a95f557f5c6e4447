; TuneDeck's Windows installer: per user, no administrator rights.
;
; Installs uv and TuneDeck's wheel into %LOCALAPPDATA%\TuneDeck (or a folder the user picks), creates the
; private Python environment there with everything except torch, and adds Start-menu and desktop shortcuts and
; an uninstaller. The app installs the torch build that fits the GPU on its first start. With a "wheelhouse"
; folder (from "Export wheelhouse") beside this installer, everything, torch included, comes from that folder
; and no network is used. Caches and the Python build stay inside the installation folder (same drive).
;
; Built by packaging/build with Debian's makensis; it passes VERSION, WHEEL, WHEEL_NAME, UV_EXE, ICON, LAUNCHER,
; OUTFILE with -D, and COMPRESSOR=zlib for a quick test build (LZMA otherwise: the smallest download).

Unicode true
RequestExecutionLevel user
!ifndef COMPRESSOR
  !define COMPRESSOR lzma
!endif
SetCompressor /SOLID ${COMPRESSOR}
ManifestLongPathAware true
ManifestDPIAware true

!include MUI2.nsh
!include LogicLib.nsh

!define PRODUCT "TuneDeck"
!define UNINSTALL_KEY "Software\Microsoft\Windows\CurrentVersion\Uninstall\TuneDeck"
!define PYTHON_VERSION "3.12"

Name "${PRODUCT} ${VERSION}"
OutFile "${OUTFILE}"
InstallDir "$LOCALAPPDATA\${PRODUCT}"
InstallDirRegKey HKCU "${UNINSTALL_KEY}" "InstallLocation"
BrandingText "${PRODUCT} ${VERSION}"
ShowInstDetails show
VIProductVersion "${VERSION}.0"
VIAddVersionKey "ProductName" "${PRODUCT}"
VIAddVersionKey "ProductVersion" "${VERSION}"
VIAddVersionKey "FileDescription" "${PRODUCT} installer"
VIAddVersionKey "FileVersion" "${VERSION}"
VIAddVersionKey "LegalCopyright" "Apache-2.0"

!define MUI_ICON "${ICON}"
!define MUI_UNICON "${ICON}"
!define MUI_ABORTWARNING
!define MUI_FINISHPAGE_RUN
!define MUI_FINISHPAGE_RUN_FUNCTION StartTuneDeck
!insertmacro MUI_PAGE_WELCOME
!insertmacro MUI_PAGE_DIRECTORY
!insertmacro MUI_PAGE_INSTFILES
!insertmacro MUI_PAGE_FINISH
!insertmacro MUI_UNPAGE_CONFIRM
!insertmacro MUI_UNPAGE_INSTFILES
!insertmacro MUI_LANGUAGE "English"

Var Offline      ; uv arguments for installing from a wheelhouse, empty when online
Var BasePython   ; folder of the Python build the environment uses (for the windowless launcher)

!macro SetEnv NAME VALUE
  System::Call 'kernel32::SetEnvironmentVariable(t "${NAME}", t "${VALUE}") i'
!macroend

!macro Run TITLE COMMAND
  DetailPrint "${TITLE}"
  nsExec::ExecToLog '${COMMAND}'
  Pop $0
  ${If} $0 != 0
    MessageBox MB_ICONSTOP "${TITLE} failed (exit code $0).$\r$\nThe details are listed above; run the installer again to retry." /SD IDOK
    Abort "${TITLE} failed"
  ${EndIf}
!macroend

Function StartTuneDeck
  Exec '"$BasePython\pythonw.exe" "$INSTDIR\launch.pyw"'
FunctionEnd

; The "home = ..." line of pyvenv.cfg names the folder of the Python build.
Function ReadBasePython
  StrCpy $BasePython ""
  FileOpen $1 "$INSTDIR\env\pyvenv.cfg" r
  ${Do}
    FileRead $1 $2
    ${If} ${Errors}
      ${Break}
    ${EndIf}
    StrCpy $3 $2 7
    ${If} $3 == "home = "
      StrCpy $BasePython $2 "" 7
      ${Do}
        StrCpy $3 $BasePython 1 -1
        ${If} $3 == "$\r"
        ${OrIf} $3 == "$\n"
          StrCpy $BasePython $BasePython -1
        ${Else}
          ${Break}
        ${EndIf}
      ${Loop}
      ${Break}
    ${EndIf}
  ${Loop}
  FileClose $1
FunctionEnd

Section "TuneDeck" Main
  SetOutPath "$INSTDIR"
  File "/oname=uv.exe" "${UV_EXE}"
  File "/oname=tunedeck.ico" "${ICON}"
  File "/oname=launch.pyw" "${LAUNCHER}"
  SetOutPath "$INSTDIR\wheels"
  Delete "$INSTDIR\wheels\tunedeck-*.whl"
  File "/oname=${WHEEL_NAME}" "${WHEEL}"
  SetOutPath "$INSTDIR"

  !insertmacro SetEnv "UV_CACHE_DIR" "$INSTDIR\cache\uv"
  !insertmacro SetEnv "UV_PYTHON_INSTALL_DIR" "$INSTDIR\python"
  !insertmacro SetEnv "UV_NO_CONFIG" "1"
  !insertmacro SetEnv "UV_NO_PROGRESS" "1"

  StrCpy $Offline ""
  ${If} ${FileExists} "$EXEDIR\wheelhouse\*.whl"
    StrCpy $Offline '--offline --no-index --find-links "$EXEDIR\wheelhouse"'
    DetailPrint "Installing from $EXEDIR\wheelhouse, without network"
  ${EndIf}

  CreateDirectory "$INSTDIR\cache"
  FileOpen $1 "$INSTDIR\cache\excludes.txt" w
  FileWrite $1 "torch$\r$\n"
  FileClose $1

  ; A new environment is built beside the old one and replaces it only when complete (re-running = repair).
  RMDir /r "$INSTDIR\env.new"
  !insertmacro Run "Creating the Python ${PYTHON_VERSION} environment" '"$INSTDIR\uv.exe" venv --relocatable --managed-python --python ${PYTHON_VERSION} "$INSTDIR\env.new"'
  !insertmacro Run "Installing TuneDeck (everything except torch)" '"$INSTDIR\uv.exe" pip install --python "$INSTDIR\env.new\Scripts\python.exe" --excludes "$INSTDIR\cache\excludes.txt" $Offline "$INSTDIR\wheels\${WHEEL_NAME}"'
  RMDir /r "$INSTDIR\env"
  ${If} ${FileExists} "$INSTDIR\env\*.*"
    MessageBox MB_ICONSTOP "The old environment is in use: close TuneDeck and run the installer again." /SD IDOK
    Abort
  ${EndIf}
  Rename "$INSTDIR\env.new" "$INSTDIR\env"
  FileOpen $1 "$INSTDIR\env\.tunedeck-ready" w
  FileClose $1

  FileOpen $1 "$INSTDIR\tunedeck-install.json" w
  FileWrite $1 '{"version": "${VERSION}", "python": "${PYTHON_VERSION}"}$\r$\n'
  FileClose $1

  ${If} ${FileExists} "$EXEDIR\wheelhouse\torch-*.whl"
    !insertmacro Run "Installing torch from the wheelhouse" '"$INSTDIR\env\Scripts\python.exe" -m engine.setup install-torch --root "$INSTDIR" --wheelhouse "$EXEDIR\wheelhouse"'
  ${EndIf}

  Call ReadBasePython
  ${If} $BasePython == ""
    MessageBox MB_ICONSTOP "The new environment has no pyvenv.cfg; run the installer again." /SD IDOK
    Abort
  ${EndIf}
  CreateShortcut "$SMPROGRAMS\${PRODUCT}.lnk" "$BasePython\pythonw.exe" '"$INSTDIR\launch.pyw"' "$INSTDIR\tunedeck.ico" 0
  CreateShortcut "$DESKTOP\${PRODUCT}.lnk" "$BasePython\pythonw.exe" '"$INSTDIR\launch.pyw"' "$INSTDIR\tunedeck.ico" 0

  WriteUninstaller "$INSTDIR\Uninstall.exe"
  WriteRegStr HKCU "${UNINSTALL_KEY}" "DisplayName" "${PRODUCT}"
  WriteRegStr HKCU "${UNINSTALL_KEY}" "DisplayVersion" "${VERSION}"
  WriteRegStr HKCU "${UNINSTALL_KEY}" "Publisher" "${PRODUCT}"
  WriteRegStr HKCU "${UNINSTALL_KEY}" "DisplayIcon" "$INSTDIR\tunedeck.ico"
  WriteRegStr HKCU "${UNINSTALL_KEY}" "InstallLocation" "$INSTDIR"
  WriteRegStr HKCU "${UNINSTALL_KEY}" "UninstallString" '"$INSTDIR\Uninstall.exe"'
  WriteRegDWORD HKCU "${UNINSTALL_KEY}" "NoModify" 1
  WriteRegDWORD HKCU "${UNINSTALL_KEY}" "NoRepair" 1
SectionEnd

Section "Uninstall"
  Delete "$SMPROGRAMS\${PRODUCT}.lnk"
  Delete "$DESKTOP\${PRODUCT}.lnk"
  ; Only what the installer and the app created: the folder may hold the user's own files.
  RMDir /r "$INSTDIR\env"
  RMDir /r "$INSTDIR\env.new"
  RMDir /r "$INSTDIR\env.old"
  RMDir /r "$INSTDIR\python"
  RMDir /r "$INSTDIR\wheels"
  RMDir /r "$INSTDIR\logs"
  RMDir /r "$INSTDIR\cache\uv"
  RMDir /r "$INSTDIR\cache\pip"
  ${If} ${FileExists} "$INSTDIR\cache\huggingface\*.*"
    MessageBox MB_YESNO|MB_ICONQUESTION "Also delete the downloaded models in $INSTDIR\cache\huggingface?" /SD IDNO IDNO keep_models
    RMDir /r "$INSTDIR\cache\huggingface"
    keep_models:
  ${EndIf}
  RMDir /r "$INSTDIR\cache\torch"
  RMDir /r "$INSTDIR\cache\triton"
  Delete "$INSTDIR\cache\excludes.txt"
  RMDir "$INSTDIR\cache"
  Delete "$INSTDIR\uv.exe"
  Delete "$INSTDIR\launch.pyw"
  Delete "$INSTDIR\tunedeck.ico"
  Delete "$INSTDIR\tunedeck-install.json"
  Delete "$INSTDIR\Uninstall.exe"
  RMDir "$INSTDIR"
  DeleteRegKey HKCU "${UNINSTALL_KEY}"
SectionEnd
